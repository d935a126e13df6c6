"""The demo target: a small Llama trained from scratch on the demo corpus, deterministically (docs/demo_target.md)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import platform
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.nn.utils.rnn import pad_sequence

from eagle31.io import atomic_write_json, sha256_file
from eagle31.optim import lr_lambda
from eagle31.targets import demo_corpus
from eagle31.targets.cache import cache_dir, ensure_built

log = logging.getLogger(__name__)

# Bump when the code changes the built files (the cache key also hashes the recipe and the corpus).
DEMO_BUILD_VERSION = "3"

DEMO_SPECIAL_TOKENS = ("<|bos|>", "<|end|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>")

DEMO_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if not messages or messages[0].role != 'system' -%}"
    "{{- '<|system|>\\n" + demo_corpus.SYSTEM_PROMPT + "<|end|>' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('the demo chat template has no role ' + message.role) -}}"
    "{%- endif -%}"
    "{{- '<|' + message.role + '|>\\n' + message.content + '<|end|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class DemoRecipe:
    """Everything that defines a demo build (with the seed and DEMO_BUILD_VERSION)."""

    corpus: demo_corpus.CorpusSpec = field(default_factory=demo_corpus.CorpusSpec)
    vocab_size: int = 2048
    # 8 layers so the default aux ids (2, L//2, L-3) = (2, 4, 5) are distinct
    num_hidden_layers: int = 8
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 384
    max_position_embeddings: int = 4096
    max_len: int = 1536  # tokens per training document (runs of conversations, see training_documents)
    max_turns: int = 6
    batch_tokens: int = 4096  # padded tokens per optimizer step
    steps: int = 300
    lr: float = 5e-3
    warmup_steps: int = 20
    threads: int = 2
    eval_greedy_prompts: int = 16
    eval_greedy_tokens: int = 48


def demo_key(seed: int = 0, recipe: DemoRecipe | None = None) -> str:
    """Cache key: build version, seed, a hash of the shipped corpus and one of the recipe."""
    recipe = recipe or DemoRecipe()
    corpus = sha256_file(demo_corpus.CORPUS_FILE)[:8]
    digest = hashlib.sha256(json.dumps(dataclasses.asdict(recipe), sort_keys=True).encode()).hexdigest()[:8]
    return f"v{DEMO_BUILD_VERSION}-seed{seed}-corpus{corpus}-{digest}"


def ensure_demo_target(seed: int = 0, recipe: DemoRecipe | None = None) -> Path:
    """The cached demo target, built under a lock on first use."""

    def build(tmp: Path) -> None:
        log.info(
            "building the demo target, once: it is cached in %s and reused by later runs "
            "(a few minutes on 2 CPU cores)",
            cache_dir() / "targets",
        )
        build_demo_target(tmp, seed=seed, recipe=recipe)

    return ensure_built("demo", demo_key(seed, recipe), build)


def demo_corpus_dir(seed: int = 0) -> Path:
    """The JSONL splits of the (cached, built on first use) demo target."""
    return ensure_demo_target(seed) / "corpus"


def build_demo_target(out_dir: str | Path, seed: int = 0, recipe: DemoRecipe | None = None) -> Path:
    """Build the demo target into `out_dir` (created); returns it."""
    recipe = recipe or DemoRecipe()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with deterministic_torch(recipe.threads):
        _phase(1, "corpus: conversations about the Python standard library")
        splits = demo_corpus.make_splits(demo_corpus.functions(), recipe.corpus, seed)
        demo_corpus.write_splits(splits, out / "corpus")
        _phase(2, f"tokenizer: byte-level BPE, {recipe.vocab_size} tokens")
        tokenizer = train_tokenizer(splits["train"], recipe)
        torch.manual_seed(seed)
        model = new_model(tokenizer, recipe)
        _phase(3, f"training: {recipe.steps} steps")
        train(model, tokenizer, splits["train"], recipe, seed)
        _phase(4, "evaluation: held-out and long-prompt splits")
        metrics = {name: evaluate(model, tokenizer, splits[name], recipe) for name in ("heldout", "long_prompt")}
    _phase(5, "saving")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    atomic_write_json(out / "build_info.json", {
        "name": "eagle31-demo", "build_version": DEMO_BUILD_VERSION, "seed": seed,
        "python_version": platform.python_version(), "torch_version": torch.__version__,
        "corpus_sha256": sha256_file(demo_corpus.CORPUS_FILE), "recipe": dataclasses.asdict(recipe),
        "splits": {name: len(rows) for name, rows in splits.items()},
        "metrics": metrics,
    })  # fmt: skip
    log.info("demo target built in %s", _clock(time.perf_counter() - started))
    return out


BUILD_PHASES = 5


def _phase(i: int, what: str) -> None:
    log.info("demo target [%d/%d] %s", i, BUILD_PHASES, what)


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(round(seconds)), 60)
    return f"{minutes}:{seconds:02d}"


@contextmanager
def deterministic_torch(threads: int) -> Iterator[None]:
    """Fixed thread count, deterministic algorithms and a private RNG; restored on exit."""
    threads_before, deterministic_before = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    fill_before = torch.utils.deterministic.fill_uninitialized_memory
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False  # NaN-filling every new tensor costs ~15%
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.set_num_threads(threads_before)
        torch.use_deterministic_algorithms(deterministic_before)
        torch.utils.deterministic.fill_uninitialized_memory = fill_before


def train_tokenizer(conversations: list[dict], recipe: DemoRecipe):
    """Byte-level BPE over the message texts, with the demo's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size, special_tokens=list(DEMO_SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator((m["content"] for c in conversations for m in c["messages"]), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|end|>", pad_token="<|pad|>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"], chat_template=DEMO_CHAT_TEMPLATE,
        model_max_length=recipe.max_position_embeddings,
    )  # fmt: skip


def new_model(tokenizer, recipe: DemoRecipe):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=recipe.hidden_size, intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_hidden_layers, num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads, head_dim=recipe.hidden_size // recipe.num_attention_heads,
        max_position_embeddings=recipe.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    model.generation_config.do_sample = False
    return model


def token_ids(tokenizer, conversations: list[dict], add_generation_prompt: bool = False) -> list[list[int]]:
    """Token ids of each rendered conversation."""
    texts = tokenizer.apply_chat_template(
        [c["messages"] for c in conversations], tokenize=False, add_generation_prompt=add_generation_prompt
    )
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def training_documents(tokenizer, conversations: list[dict], recipe: DemoRecipe, seed: int) -> list[list[int]]:
    """The target's training sequences: runs of 1..`max_turns` training conversations, each merged into one
    multi-turn conversation of at most `max_len` tokens (the long-prompt split needs long contexts)."""
    lengths = [len(x) for x in token_ids(tokenizer, conversations)]
    rng = random.Random(seed)
    runs, i = [], 0
    while i < len(conversations):
        turns, j, total = rng.randint(1, recipe.max_turns), i + 1, lengths[i]
        while j < len(conversations) and j - i < turns and total + lengths[j] <= recipe.max_len:
            total += lengths[j]
            j += 1
        runs.append(demo_corpus.merge(conversations[i:j]))
        i = j
    return [x[: recipe.max_len] for x in token_ids(tokenizer, runs)]


def length_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped by length so that each padded batch holds at most `batch_tokens`."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and (len(current) + 1) * lengths[i] > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    return batches + [current] if current else batches


def pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded `input_ids [B, T]` and `attention_mask [B, T]`."""
    ids = pad_sequence([torch.tensor(s) for s in seqs], batch_first=True, padding_value=pad_id)
    return ids, pad_sequence([torch.ones(len(s), dtype=torch.long) for s in seqs], batch_first=True)


def train(model, tokenizer, conversations: list[dict], recipe: DemoRecipe, seed: int) -> None:
    """AdamW with warmup and cosine decay on every token of the training documents."""
    ids = training_documents(tokenizer, conversations, recipe, seed)
    batches = length_batches([len(x) for x in ids], recipe.batch_tokens)
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(recipe.warmup_steps, recipe.steps))  # cosine to lr / 10
    model.train()
    started = time.perf_counter()
    order: list[int] = []
    for step in range(recipe.steps):
        if not order:  # a new epoch: batches in a fresh seeded order
            order = list(range(len(batches)))
            rng.shuffle(order)
        input_ids, attention_mask = pad([ids[i] for i in batches[order.pop()]], tokenizer.pad_token_id)
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 20 == 0 or step == recipe.steps - 1:
            eta = (time.perf_counter() - started) / (step + 1) * (recipe.steps - step - 1)
            log.info("demo target [3/%d] step %d/%d, loss %.3f, ETA %s", BUILD_PHASES, step + 1, recipe.steps,
                     loss.item(), _clock(eta))  # fmt: skip
    model.eval()


@torch.no_grad()
def evaluate(model, tokenizer, conversations: list[dict], recipe: DemoRecipe) -> dict[str, float]:
    """Quality on the last assistant answer of each conversation (docs/demo_target.md, "Measured quality")."""
    model.eval()
    ids = token_ids(tokenizer, conversations)
    prompts = [{"messages": c["messages"][:-1]} for c in conversations]
    prompt_lens = [len(p) for p in token_ids(tokenizer, prompts, True)]
    nll, correct, count = 0.0, 0, 0
    for batch in length_batches([len(x) for x in ids], recipe.batch_tokens):
        input_ids, attention_mask = pad([ids[i] for i in batch], tokenizer.pad_token_id)
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()  # [B, T, V]
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        targets = input_ids[:, 1:]
        answer = torch.zeros_like(targets, dtype=torch.bool)  # [B, T-1]: predicts an answer token
        for row, i in enumerate(batch):
            answer[row, prompt_lens[i] - 1 : len(ids[i]) - 1] = True
        nll -= logp.gather(-1, targets[..., None])[..., 0][answer].sum().item()
        correct += (logp.argmax(-1) == targets)[answer].sum().item()
        count += int(answer.sum())
    prefix_match, token_match = [], []
    for i in range(min(recipe.eval_greedy_prompts, len(ids))):
        ref = ids[i][prompt_lens[i] :][: recipe.eval_greedy_tokens]
        same = [a == b for a, b in zip(greedy(model, ids[i][: prompt_lens[i]], len(ref)), ref, strict=False)]
        same += [False] * (len(ref) - len(same))  # stopped early
        prefix_match.append(same.index(False) if False in same else len(same))
        token_match.append(sum(same) / len(ref))
    return {
        "loss": round(nll / count, 4),
        "top1": round(correct / count, 4),
        "greedy_prefix_match": round(sum(prefix_match) / max(1, len(prefix_match)), 2),
        "greedy_token_match": round(sum(token_match) / max(1, len(token_match)), 4),
        "answer_tokens": count,
    }


@torch.no_grad()
def greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation of one prompt (stops after the eos token)."""
    out = model.generate(
        torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()
