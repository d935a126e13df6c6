"""The drafter at inference: a KV cache of step-0 keys, chain drafting and EAGLE-2 draft trees (docs/evaluation.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from eagle31.model import DraftStep, Eagle31Drafter


@dataclass(frozen=True)
class TreeSpec:
    """EAGLE-2 tree: `top_k` children and nodes a level, `depth` levels, `total_tokens` kept (docs/evaluation.md)."""

    top_k: int
    depth: int
    total_tokens: int

    def __post_init__(self) -> None:
        for name in ("top_k", "depth", "total_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"tree.{name} must be a positive integer, got {value!r}")


@dataclass
class DraftTree:
    """Drafts from the root (the last verified token): tokens [N] target ids, parents [N] (-1: root) before children."""

    tokens: torch.Tensor
    parents: torch.Tensor

    @classmethod
    def chain(cls, tokens: torch.Tensor) -> DraftTree:
        return cls(tokens, torch.arange(tokens.numel(), device=tokens.device) - 1)

    def __len__(self) -> int:
        return self.tokens.numel()

    def is_chain(self) -> bool:
        return bool((self.parents == torch.arange(len(self), device=self.parents.device) - 1).all())

    def depths(self) -> torch.Tensor:
        """[N] depth of each node (children of the root have depth 1): the node and its ancestors."""
        return self.ancestor_mask()[1:, 1:].sum(1)

    def ancestor_mask(self) -> torch.Tensor:
        """[N+1, N+1] bool over [root, nodes...]: row i may see column j iff j is i or an ancestor."""
        N = len(self)
        mask = torch.eye(N + 1, dtype=torch.bool)
        mask[:, 0] = True
        for i, p in enumerate(self.parents.tolist()):
            if p >= 0:
                mask[i + 1] |= mask[p + 1]
        return mask.to(self.tokens.device)


class Proposer(Protocol):
    """What the decoding loop needs from a drafter (batch size 1)."""

    def reset(self) -> None:
        """Forget the context (a new prompt)."""

    def extend(self, aux: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Add `m` verified positions: aux [m, n*Ht] their target features, next_tokens [m] the token after each."""

    def draft_chain(self, k: int) -> torch.Tensor:
        """[k] target ids: the greedy continuation of the verified context."""

    def draft_tree(self, spec: TreeSpec) -> DraftTree:
        """A draft tree for the verified context."""


class DraftProbe(Protocol):
    """Sees each step of chain drafting as it runs (the draft of depth `chain + 1`)."""

    def observe(self, feature, out: DraftStep, q, keys, values, allowed, attn, chain: int) -> None:
        """feature [1, 1, H] what the step read; q [1, 1, nh, d]; keys, values [1, S, nkv, d]: the step-0 keys, then
        its `chain` own draft keys; allowed [1, 1, S]; attn [1, 1, nh, d]. `chain` 0: a round's first draft."""


class EagleProposer:
    """`Proposer` for an `Eagle31Drafter`, with a KV cache of step-0 keys."""

    def __init__(self, drafter: Eagle31Drafter, probe: DraftProbe | None = None):
        self.drafter = drafter
        self.probe = probe  # chains only: draft trees are not observed
        self.reset()

    def reset(self) -> None:
        self.length = 0  # verified positions in the cache
        self.keys: torch.Tensor | None = None  # step-0 keys [1, length, nkv, d]
        self.values: torch.Tensor | None = None
        self.root: torch.Tensor | None = None  # step-0 output o (`DraftStep.hidden`) at position length-1, [1, 1, H]

    @torch.no_grad()
    def extend(self, aux: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Step-0 keys of `m` verified positions from the target's features (`Proposer.extend`)."""
        m = next_tokens.numel()
        feature = self.drafter.fuse_aux(aux.reshape(1, m, -1).to(self.drafter.fc.weight.dtype))  # [1, m, H]
        positions = torch.arange(self.length, self.length + m, device=feature.device)[None]
        q, k, v, residual = self.drafter.step_qkv(feature, next_tokens.reshape(1, m), positions)
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=1)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=1)
        self.length += m
        # only the last position's output is needed: it seeds the next draft
        allowed = self._visible([0], [])
        attn = _attend(q[:, -1:], self.keys, self.values, allowed)
        root = self.drafter.step_output(residual[:, -1:], attn)
        self.root = root.hidden
        if self.probe is not None:
            self.probe.observe(feature[:, -1:], root, q[:, -1:], self.keys, self.values, allowed, attn, chain=0)

    @torch.no_grad()
    def draft_chain(self, k: int) -> torch.Tensor:
        """[k] target ids: a chain drafter's greedy continuation, a parallel drafter's (`draft_parallel`)."""
        self._check_ready()
        if self.drafter.config.parallel_drafting:
            return self.draft_parallel(k)
        out, keys, values = self.drafter.read_out(self.root), self.keys, self.values
        drafts = []
        for step in range(1, k + 1):
            token = self.drafter.draft_to_target(self.drafter.lm_head(out.state).argmax(-1))  # [1, 1]
            drafts.append(token)
            if step == k:
                break
            position = torch.full((1, 1), self.length - 1 + step, device=token.device)
            q, key, value, residual = self.drafter.step_qkv(out.feature, token, position)
            keys, values = torch.cat([keys, key], dim=1), torch.cat([values, value], dim=1)  # [1, length + step, ...]
            allowed = self._visible([step], list(range(1, step + 1)))
            feature, attn = out.feature, _attend(q, keys, values, allowed)
            out = self.drafter.step_output(residual, attn)
            if self.probe is not None:
                self.probe.observe(feature, out, q, keys, values, allowed, attn, chain=step)
        return torch.cat(drafts, dim=1)[0]

    @torch.no_grad()
    def draft_parallel(self, k: int) -> torch.Tensor:
        """[k] target ids in one forward (vLLM's parallel drafting): the root's draft, k - 1 mask slots."""
        root = self.drafter.read_out(self.root)
        first = self.drafter.draft_to_target(self.drafter.lm_head(root.state).argmax(-1))  # [1, 1]
        if k == 1:
            return first[0]
        feature, tokens = self.drafter.mask_slots((1, k - 1), first.device)
        positions = self.length + torch.arange(k - 1, device=first.device)[None]  # slot i at (n - 1) + i
        q, key, value, residual = self.drafter.step_qkv(feature, tokens, positions)
        keys, values = torch.cat([self.keys, key], dim=1), torch.cat([self.values, value], dim=1)
        slots = list(range(1, k))
        allowed = self._visible(slots, slots)
        attn = _attend(q, keys, values, allowed)
        out = self.drafter.step_output(residual, attn)
        for i in slots:  # each slot as the step of its depth
            at = slice(i - 1, i)
            if self.probe is not None:
                step = DraftStep(out.hidden[:, at], out.state[:, at], out.feature[:, at])
                self.probe.observe(feature[:, at], step, q[:, at], keys, values, allowed[:, at], attn[:, at], chain=i)
        return torch.cat([first, self.drafter.draft_to_target(self.drafter.lm_head(out.state).argmax(-1))], dim=1)[0]

    @torch.no_grad()
    def draft_tree(self, spec: TreeSpec) -> DraftTree:
        """EAGLE-2 expansion and reranking (docs/evaluation.md); candidates kept in creation order, parents first."""
        self._check_ready()
        if self.drafter.config.parallel_drafting:
            raise ValueError("a parallel drafter drafts its k tokens in one forward, not trees: draft chains with it")
        top_k, vocab = spec.top_k, self.drafter.config.draft_vocab_size
        if top_k > vocab:
            raise ValueError(f"tree.top_k={top_k} exceeds the drafter's draft_vocab_size={vocab}")
        root = self.drafter.read_out(self.root)
        scores, ids = self._log_probs(root.state[0, 0]).topk(top_k)  # [top_k]
        tokens = self.drafter.draft_to_target(ids)
        parents = torch.full((top_k,), -1, dtype=torch.long, device=ids.device)
        features = root.feature[0].expand(top_k, -1)  # [P, H]: the feature each candidate's expansion reads
        frontier = torch.arange(top_k, device=ids.device)  # candidates expanded at the next level
        keys, values = self.keys, self.values
        key_nodes: list[int] = []  # the candidate each draft key belongs to
        depths = [1] * top_k  # each candidate's level (the roots' children are at 1)
        for level in range(1, spec.depth):
            width = frontier.numel()
            position = torch.full((1, width), self.length - 1 + level, device=ids.device)
            q, key, value, residual = self.drafter.step_qkv(features[frontier][None], tokens[frontier][None], position)
            keys, values = torch.cat([keys, key], dim=1), torch.cat([values, value], dim=1)
            key_nodes += frontier.tolist()
            allowed = self._tree_visible(frontier.tolist(), key_nodes, parents.tolist(), depths)
            out = self.drafter.step_output(residual, _attend(q, keys, values, allowed))  # each [1, width, H]
            child_scores, child_ids = self._log_probs(out.state)[0].topk(top_k, dim=-1)  # [width, top_k]
            child_scores = (scores[frontier, None] + child_scores).flatten()
            first = scores.numel()
            scores = torch.cat([scores, child_scores])
            tokens = torch.cat([tokens, self.drafter.draft_to_target(child_ids).flatten()])
            parents = torch.cat([parents, frontier.repeat_interleave(top_k)])
            depths += [level + 1] * child_ids.numel()
            features = torch.cat([features, out.feature[0].repeat_interleave(top_k, dim=0)])
            frontier = first + child_scores.topk(top_k).indices
        # rerank: a child never scores above its parent (log-probs <= 0) and the stable sort
        # puts the earlier-created parent first on ties, so the kept set is a tree
        keep = scores.sort(descending=True, stable=True).indices[: spec.total_tokens].sort().values
        index = torch.full((parents.numel() + 1,), -1, device=keep.device)  # index[-1]: the root stays -1
        index[keep] = torch.arange(keep.numel(), device=keep.device)
        return DraftTree(tokens[keep], index[parents[keep]])

    def _check_ready(self) -> None:
        if self.root is None:
            raise RuntimeError("EagleProposer: call extend() with the verified context before drafting")

    def _log_probs(self, state: torch.Tensor) -> torch.Tensor:
        """state [..., H] (`DraftStep.state`) -> log-probabilities [..., Vd] over the draft vocabulary."""
        return self.drafter.lm_head(state).float().log_softmax(-1)

    def _visible(self, query_steps: list[int], key_steps: list[int]) -> torch.Tensor:
        """[1, Q, S] the rule's mask: queries (n-1, s) over step-0 keys 0..n-1, draft keys at `key_steps`."""
        assert self.keys is not None
        n, device = self.length, self.keys.device
        k_pos = torch.cat([torch.arange(n), torch.full((len(key_steps),), n - 1)]).to(device)
        k_step = torch.cat([torch.zeros(n, dtype=torch.long), torch.tensor(key_steps, dtype=torch.long)]).to(device)
        q_step = torch.tensor(query_steps, device=device)[:, None]
        doc = torch.zeros((), dtype=torch.long, device=device)
        return self.drafter.visibility(doc, n - 1, q_step, doc, k_pos[None], k_step[None])[None]

    def _tree_visible(self, queries: list[int], key_nodes: list[int], parents: list[int], depths: list[int]):
        """[1, len(queries), S]: `_visible` by level, of the draft keys only the query's own and its ancestors'."""
        allowed = self._visible([depths[n] for n in queries], [depths[n] for n in key_nodes])
        column = {node: self.length + i for i, node in enumerate(key_nodes)}
        lineage = torch.zeros_like(allowed)
        lineage[..., : self.length] = True
        for row, node in enumerate(queries):
            while node >= 0:
                lineage[0, row, column[node]] = True
                node = parents[node]
        return allowed & lineage


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """q [1, Q, nh, d], k/v [1, S, nkv, d], allowed [1, Q, S] bool -> [1, Q, nh, d]."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed[:, None], enable_gqa=True
    )
    return out.transpose(1, 2)
