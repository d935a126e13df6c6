"""Builders for the speculative-decoding tests: a tokenizer for the drafter-sized target, an oracle drafter."""

from __future__ import annotations

from pathlib import Path

import torch

from eagle31.eval.drafting import DraftTree
from tests.tiny_targets import DRAFTER_VOCAB as VOCAB
from tests.tiny_targets import drafter_sized_llama

AUX = (2, 4, 5)  # fits tests.helpers.tiny_config (8 target layers)
SPECIAL = ["<unk>", "<s>", "<end>", "<|system|>", "<|user|>", "<|assistant|>"]
WORDS = "you are a helpful assistant write python function code the def return for in if x y n list sum of two".split()
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <end> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_tokenizer():
    """A word-level tokenizer (ids < VOCAB) with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIAL + WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="<end>",
        additional_special_tokens=SPECIAL[3:],
        chat_template=CHAT_TEMPLATE,
    )


def save_target(path: Path, seed: int = 0) -> Path:
    """A target directory as `from_pretrained` reads it (float32 weights, tokenizer)."""
    drafter_sized_llama(seed, dtype=torch.float32).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@torch.no_grad()
def naive_greedy(target, prompt: torch.Tensor, n: int) -> torch.Tensor:
    """prompt + the target's n greedy tokens, one full forward per token (no cache)."""
    ids = prompt.clone()
    for _ in range(n):
        ids = torch.cat([ids, target(ids[None]).logits[0, -1:].argmax(-1)])
    return ids


class Oracle:
    """Test-harness proposer that knows the target's greedy sequence `ref`.

    In round r it gets the first `good(r, k)` drafts right and the rest wrong. Its
    tree puts a wrong decoy before the real node at every level, so the accepted
    path is never the first sibling.
    """

    def __init__(self, ref: torch.Tensor, good=lambda r, k: k, vocab: int = VOCAB):
        self.ref, self.good, self.vocab = ref, good, vocab

    def reset(self):
        self.length = self.round = 0

    def extend(self, aux, next_tokens):
        self.length += next_tokens.numel()

    def _drafts(self, k):
        truth = self.ref[self.length + 1 : self.length + 1 + k]
        good = self.good(self.round, k)
        self.round += 1
        return torch.cat([truth[:good], (truth[good:] + 1) % self.vocab])

    def draft_chain(self, k):
        return self._drafts(k)

    def draft_tree(self, spec):
        tokens, parents, real = [], [], -1
        for t in self._drafts(spec.depth).tolist():
            tokens += [(t + 2) % self.vocab, t]
            parents += [real, real]
            real = len(tokens) - 1
        return DraftTree(torch.tensor(tokens), torch.tensor(parents))
