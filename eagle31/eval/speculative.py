"""Greedy speculative decoding with an HF target, live or replayed from a `GreedyTrace` (docs/evaluation.md)."""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from eagle31.errors import ConfigError
from eagle31.eval.drafting import DraftTree, Proposer, TreeSpec
from eagle31.target import TargetFeatures


@dataclass
class Generation:
    """One prompt's speculative decoding."""

    tokens: list[int]  # generated ids (prompt excluded), cut after EOS / at max_new_tokens
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted per verification round
    target_forwards: int = 0  # prefill + verification passes
    seconds: float = 0.0


@dataclass
class GreedyTrace:
    """The target's greedy decoding of one prompt: tokens [n + L + 1] (the prompt, then its choice after each
    position) and its features aux [n + L, n_aux*Ht] at every position but the last."""

    prompt_len: int
    tokens: torch.Tensor
    aux: torch.Tensor

    @property
    def continuation(self) -> list[int]:
        return self.tokens[self.prompt_len :].tolist()


class TargetRunner:
    """The target with its KV cache: prefill, verification of a draft tree, rollback."""

    def __init__(self, model, aux_layer_ids):
        self.model = model
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.cache = DynamicCache(config=model.config)
        kinds = {type(layer).__name__ for layer in self.cache.layers if type(layer) is not DynamicLayer}
        if kinds:  # sliding-window or linear-attention layers cannot drop rejected positions
            raise ConfigError(f"speculative decoding needs full-attention cache layers; the target has {sorted(kinds)}")
        self.forwards = 0
        # transformers renamed `past_key_values` to `cache` in 5.x
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [n] -> (aux [n, n_aux*Ht], the target's next token [1])."""
        logits, aux = self._forward(input_ids[None], logits_to_keep=1)
        return aux, logits[-1:].argmax(-1)

    def verify(self, root: torch.Tensor, tree: DraftTree) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """Run `[root [1] (not yet cached), tree tokens]`, keep the accepted path; -> (its node indices, the bonus token
        [1], aux [a+1, ·] of root + accepted nodes, now the cache's newest positions)."""
        past = self.cache.get_seq_length()
        inputs = torch.cat([root.view(1), tree.tokens])[None]  # [1, N+1]
        if tree.is_chain():  # plain causal attention is the chain's tree mask
            logits, aux = self._forward(inputs)
        else:
            depths = tree.depths()
            positions = past + torch.cat([depths.new_zeros(1), depths])[None]  # the root sits at `past`
            # additive mask [1, 1, N+1, past+N+1]: each of [root, nodes] sees the cache, itself and its ancestors
            mask = torch.zeros(len(tree) + 1, past + len(tree) + 1, dtype=self.model.dtype, device=inputs.device)
            mask[:, past:].masked_fill_(~tree.ancestor_mask(), torch.finfo(self.model.dtype).min)
            logits, aux = self._forward(inputs, position_ids=positions, attention_mask=mask[None, None])
        greedy = logits.argmax(-1)  # [N+1] the target's token after each input
        path = accepted_path(tree, greedy)
        rows = [0] + [1 + i for i in path]  # inputs to keep: the root and the accepted nodes
        self._retain(past, rows)
        rows = torch.tensor(rows, device=inputs.device)
        return path, greedy[rows[-1:]], aux[rows]

    def _forward(self, input_ids, *, logits_to_keep: int = 0, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """-> logits [m', V] (the last `logits_to_keep` positions, all when 0), aux [m, ·]."""
        with TargetFeatures(self.model, self.aux_layer_ids) as feats:
            out = self.model(input_ids=input_ids, use_cache=True, logits_to_keep=logits_to_keep,
                             **{self._cache_arg: self.cache}, **kwargs)  # fmt: skip
            aux, _ = feats.pop()
        self.forwards += 1
        return out.logits[0], aux[0]

    def _retain(self, past: int, rows: list[int]) -> None:
        """Keep the first `past` cached positions and, after them, the new ones at `rows` (increasing)."""
        keep: slice | torch.Tensor = slice(past + len(rows))  # a chain's accepted rows: a plain crop
        if rows[-1] != len(rows) - 1:
            keep = torch.cat([torch.arange(past), torch.tensor(rows) + past]).to(self.cache.layers[0].keys.device)
        for layer in self.cache.layers:
            layer.keys, layer.values = layer.keys[..., keep, :], layer.values[..., keep, :]


class ReplayedTarget:
    """`TargetRunner`'s prefill and verification, read off a `GreedyTrace` (docs/evaluation.md, replay)."""

    def __init__(self, trace: GreedyTrace):
        self.trace = trace
        self.past = 0  # positions verified so far (the live runner's cache length)
        self.forwards = 0

    def prefill(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = input_ids.numel()
        if n != self.trace.prompt_len or not torch.equal(input_ids.cpu(), self.trace.tokens[:n].cpu()):
            raise ValueError("the trace was recorded for another prompt")
        self.past, self.forwards = n, 1
        return self.trace.aux[:n], self.trace.tokens[n : n + 1]

    def verify(self, root: torch.Tensor, tree: DraftTree) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        past, tokens = self.past, self.trace.tokens
        # the target's choice after the root and after each node, were it on the greedy path
        # (accepted_path only reads it for nodes that are)
        after = past + 1 + torch.cat([tree.depths().new_zeros(1), tree.depths()])
        if int(after.max()) >= tokens.numel():
            raise ValueError(f"the trace ends at {tokens.numel()} tokens; this round reads position {int(after.max())}")
        path = accepted_path(tree, tokens[after.to(tokens.device)])
        self.past = past + len(path) + 1
        self.forwards += 1
        return path, tokens[self.past : self.past + 1], self.trace.aux[past : self.past]


@torch.no_grad()
def greedy_trace(target, input_ids: torch.Tensor, *, aux_layer_ids, length: int) -> GreedyTrace:
    """The target's greedy decoding of input_ids [n], `length` + 1 tokens, past EOS (a round may draft past it)."""
    runner = TargetRunner(target, aux_layer_ids)
    aux, token = runner.prefill(input_ids)
    auxes, tokens = [aux], [input_ids, token]
    no_drafts = DraftTree.chain(input_ids.new_empty(0))
    for _ in range(length):
        _, token, aux = runner.verify(token, no_drafts)
        auxes.append(aux)
        tokens.append(token)
    return GreedyTrace(prompt_len=input_ids.numel(), tokens=torch.cat(tokens), aux=torch.cat(auxes))


def accepted_path(tree: DraftTree, greedy: torch.Tensor) -> list[int]:
    """The longest root-to-node path whose tokens equal greedy [N+1], the target's argmax after root and each node."""
    choice = greedy.tolist()
    path: list[int] = []
    for node, (token, parent) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist(), strict=True)):
        # parents come before their children: the first matching child of the path's end extends it
        if parent == (path[-1] if path else -1) and token == choice[parent + 1]:
            path.append(node)
    return path


def draft_length(k: int | None, tree: TreeSpec | None) -> int:
    """The most drafts a round makes: `k` for a chain, the tree's depth; exactly one of the two is given."""
    if k is None and tree is not None:
        return tree.depth
    if k is None or tree is not None:
        raise ValueError("give exactly one of k (chain drafting) and tree (draft trees)")
    if k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    return k


@torch.no_grad()
def speculative_generate(
    target, proposer: Proposer, input_ids: torch.Tensor, *, aux_layer_ids, max_new_tokens: int, k: int | None = None,
    tree: TreeSpec | None = None, eos_token_ids=(),
) -> Generation:  # fmt: skip
    """Greedy speculative decoding of input_ids [n] with chains of `k` drafts or draft trees; `target` is the model, or
    a `GreedyTrace` of its decoding of input_ids (at least `max_new_tokens` + the draft depth long) to replay."""
    k = draft_length(k, tree)
    eos = set(eos_token_ids)
    start = time.perf_counter()
    runner = ReplayedTarget(target) if isinstance(target, GreedyTrace) else TargetRunner(target, aux_layer_ids)
    proposer.reset()
    aux, token = runner.prefill(input_ids)
    proposer.extend(aux, torch.cat([input_ids[1:], token]))
    result = Generation(tokens=token.tolist())
    done = not eos.isdisjoint(result.tokens)
    while len(result.tokens) < max_new_tokens and not done:
        drafts = DraftTree.chain(proposer.draft_chain(k)) if tree is None else proposer.draft_tree(tree)
        path, token, aux = runner.verify(token, drafts)  # token: the bonus
        new = torch.cat([drafts.tokens[path], token])  # target ids x[n+1 .. n+a+1]
        proposer.extend(aux, new)
        result.accepted.append(len(path))
        result.tokens += new.tolist()
        done = not eos.isdisjoint(result.tokens[-len(new) :])
    # the last round counts whole in `accepted`, as in vLLM; its tokens past the end are dropped
    result.tokens = cut_generation(result.tokens, max_new_tokens, eos)
    if input_ids.is_cuda:
        torch.cuda.synchronize(input_ids.device)
    result.seconds = time.perf_counter() - start
    result.target_forwards = runner.forwards
    return result


def cut_generation(tokens: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """The generated tokens a user sees: at most `max_new_tokens`, up to and including the first EOS."""
    tokens = tokens[:max_new_tokens]
    return tokens[: next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))]
