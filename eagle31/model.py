"""The EAGLE 3.1 reference drafter, written out: the spec every fast path is tested against (docs/design.md §3-§4)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from eagle31.config import DrafterConfig, read_json_config
from eagle31.errors import ConfigError

NATIVE_FORMAT = "eagle31-drafter"
NATIVE_FORMAT_VERSION = 1


def segment_ids(document_ids, attention_mask, shape, device=None) -> torch.Tensor:
    """Document runs [B, T]; padding (document id -1, `attention_mask` 0) in runs of its own, which none attends."""
    B, T = shape
    doc = torch.zeros(B, T, dtype=torch.long, device=device) if document_ids is None else document_ids.long()
    if attention_mask is not None:
        doc = doc.to(attention_mask.device).masked_fill(attention_mask == 0, -1)
    new_run = torch.ones_like(doc, dtype=torch.bool)
    new_run[:, 1:] = doc[:, 1:] != doc[:, :-1]
    return new_run.long().cumsum(dim=1)


@dataclass(frozen=True)
class Visibility:
    """Which keys query (p, k), position p at TTT step k, sees: the one rule (docs/design.md §4, "Attention")."""

    window: int | None = None  # `drafter.sliding_window`; None: full attention

    def __call__(self, q_doc, q_pos, q_step, k_doc, k_pos, k_step) -> torch.Tensor:
        """mask_mod form: broadcastable tensors (or ints) of a query and a key -> bool, True where attended."""
        causal = (k_step == 0) & (k_pos <= q_pos)
        chain = (k_step > 0) & (k_pos == q_pos) & (k_step <= q_step)
        seen = (q_doc == k_doc) & (causal | chain)
        if self.window is not None:
            seen = seen & ((q_pos + q_step) - (k_pos + k_step) < self.window)
        return seen


def explicit_attention(q, k, v, allowed, probe=None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v over the allowed keys: q [B, Q, nh, d], k, v [B, S, nkv, d] (grouped heads),
    allowed [B, Q, S] bool -> [B, Q, nh, d]. `probe(probs)` sees the probabilities [B, nh, Q, S]."""
    g = q.shape[2] // k.shape[2]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(g, dim=2)) / math.sqrt(q.shape[-1])
    probs = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(dim=-1)
    if probe is not None:
        probe(probs)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v.repeat_interleave(g, dim=2))


class RMSNorm(nn.Module):
    """weight * (x * rsqrt(mean(x^2) + eps)), normalised in fp32 and rounded to x's dtype before the weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [*, 1]
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        n = x.to(rstd.dtype) * rstd  # the normalised x, fp32
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * n.to(x.dtype)).reshape(-1, weight.shape[0]).sum(0, dtype=rstd.dtype).to(weight.dtype)
        grad_n = (grad * weight).to(rstd.dtype)
        grad_x = rstd * (grad_n - n * (grad_n * n).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`RMSNorm` with a given weight (the memory-lean chain remakes keys with the layer's norms)."""
    return _RMSNormFunction.apply(x, weight, eps)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        if config.hidden_act != "silu":
            raise ConfigError(f"drafter.hidden_act={config.hidden_act!r} is not supported (only 'silu')")
        H, intermediate = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(H, intermediate, bias=False)
        self.up_proj = nn.Linear(H, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    """The drafter's one decoder layer (docs/design.md §3), its attention reading z [*, 2H]."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.norm_before_residual = config.norm_before_residual
        self.input_layernorm = RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.self_attn = config.kind.attention(config, RMSNorm)
        self.mlp = MLP(config)

    def attention_input(self, emb: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """emb, h [B, T, H] -> (z [B, T, 2H], the residual r)."""
        h_normed = self.hidden_norm(h)
        residual = h_normed if self.norm_before_residual else h
        return torch.cat([self.input_layernorm(emb), h_normed], dim=-1), residual

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        """h' + mlp(post_attention_layernorm(h')), position by position: [*, H]."""
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass
class DraftStep:
    """What one drafter step gives, each [B, T, H]."""

    hidden: torch.Tensor  # o: the decoder layer's output (pre-norm)
    state: torch.Tensor  # norm(o): what lm_head reads
    feature: torch.Tensor  # what the next step reads: norm(o) with `norm_output` (EAGLE 3.1), o otherwise


@dataclass
class TTTOutput:
    states: list[torch.Tensor]  # per step k: norm(o_k) [B, Tq, H], what lm_head sees
    hidden: list[torch.Tensor]  # per step k: o_k [B, Tq, H]
    segments: torch.Tensor  # [B, T] the document runs the attention respected (of the keys, on a shard)


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, t] -> x[:, t + n], padded with zeros at the end; x [B, T]."""
    return torch.cat([x[:, n:], x.new_zeros(x.shape[0], min(n, x.shape[1]))], dim=1)


class Eagle31Drafter(nn.Module):
    """EAGLE 3 drafter with the 3.1 switches (`fc_norm`, `norm_output`); d2t [Vd], t2d [V] (docs/design.md §5)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        config.validate()
        self.config = config
        H, Ht, eps = config.hidden_size, config.target_hidden_size, config.rms_norm_eps
        self.embed_tokens = nn.Embedding(config.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        self.fc_norm = nn.ModuleList([RMSNorm(Ht, eps) for _ in range(config.num_aux)]) if config.fc_norm else None
        self.input_norm = RMSNorm(config.fc_in_features, eps) if config.norm_before_fc else None
        self.fc = nn.Linear(config.fc_in_features, H, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(H, eps)
        self.lm_head = nn.Linear(H, config.draft_vocab_size, bias=False)
        self.rotary_emb = config.kind.rotary_embedding(config)
        self.visibility = Visibility(config.sliding_window)
        if config.parallel_drafting:  # the mask slots' state, an fc input (`fuse_aux` makes their feature)
            self.mask_hidden = nn.Parameter(torch.zeros(1, config.fc_in_features))
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.t2d[: config.draft_vocab_size] = True
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Llama-style init: linears N(0, std), norms at ones (fc_norm included); `mask_hidden` N(0, 1)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
        if self.config.parallel_drafting:
            self.mask_hidden.normal_(0.0, 1.0)

    @torch.no_grad()
    def init_from_target(self, embed_weight, lm_head_weight, d2t, t2d) -> None:
        """The target's embedding (frozen), lm_head rows at the draft vocabulary: weights [V, Ht], d2t [Vd], t2d [V]."""
        expected = (self.config.vocab_size, self.config.hidden_size)
        for name, weight in (("embedding", embed_weight), ("lm_head", lm_head_weight)):
            if tuple(weight.shape) != expected:
                raise ConfigError(f"target {name} has shape {tuple(weight.shape)}, drafter expects {expected}")
        self.set_vocab(d2t, t2d)
        self.embed_tokens.weight.copy_(embed_weight)
        self.lm_head.weight.copy_(lm_head_weight[self.draft_token_ids()])

    @torch.no_grad()
    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        cfg = self.config
        if d2t.shape != (cfg.draft_vocab_size,) or t2d.shape != (cfg.vocab_size,):
            raise ConfigError(
                f"vocab maps have shapes d2t {tuple(d2t.shape)}, t2d {tuple(t2d.shape)}; expected "
                f"({cfg.draft_vocab_size},), ({cfg.vocab_size},)"
            )
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_token_ids(self) -> torch.Tensor:
        """Target ids of the draft vocabulary, [Vd] ascending."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # ------------------------------------------------------------------------------- one drafter step
    # A step is split around its attention, the one part that training and inference do differently.

    def fuse_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """Step-0 feature: aux [B, T, n*Ht] -> fc(fc_norm(aux)) [B, T, H], one norm per aux chunk."""
        if self.fc_norm is not None:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)], dim=-1)
        elif self.input_norm is not None:
            aux = self.input_norm(aux)
        return self.fc(aux)

    def mask_slots(self, shape: tuple[int, int], device) -> tuple[torch.Tensor, torch.Tensor]:
        """What a parallel drafter's steps k >= 1 read (P-EAGLE's mask slots): feature [B, T, H], mask tokens [B, T]."""
        feature = self.fuse_aux(self.mask_hidden)[0].expand(*shape, -1)
        return feature, torch.full(shape, self.config.mask_token_id, dtype=torch.long, device=device)

    def embed(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        with torch.no_grad():  # the target's embedding, frozen
            return self.embed_tokens(tokens).to(dtype)  # [*, H]

    def step_qkv(self, feature: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor):
        """feature [B, T, H], tokens, RoPE positions [B, T] -> q [B, T, nh, d], k, v [B, T, nkv, d], residual."""
        z, residual = self.midlayer.attention_input(self.embed(tokens, feature.dtype), feature)
        q, entry = self.midlayer.self_attn.query_entry(z, *self.rotary_emb(positions, feature.dtype))
        keys_values = self.midlayer.self_attn.step0_keys_values()  # what the entry's keys and values are
        return q, *keys_values.fn(*entry, *keys_values.params), residual

    def step_output(self, residual: torch.Tensor, attn: torch.Tensor) -> DraftStep:
        """The step after its attention: residual [B, T, H], attn [B, T, nh, d] -> its `DraftStep`."""
        return self.read_out(self.midlayer.feed_forward(residual + self.midlayer.self_attn.output(attn)))

    def read_out(self, hidden: torch.Tensor, state: torch.Tensor | None = None) -> DraftStep:
        """o [B, T, H] -> o, norm(o) and the next step's feature (`norm_output`); `state`: norm(o) if known."""
        state = self.norm(hidden) if state is None else state
        return DraftStep(hidden=hidden, state=state, feature=state if self.config.norm_output else hidden)

    def forward(self, aux, input_ids, *, ttt_length: int = 1, **kwargs) -> list[torch.Tensor]:
        """Per-step draft logits [B, T, Vd]: step k at position p is query (p, k) (`unroll`'s arguments)."""
        return [self.lm_head(s) for s in self.unroll(aux, input_ids, ttt_length=ttt_length, **kwargs).states]

    def unroll(
        self,
        aux: torch.Tensor,
        input_ids: torch.Tensor,
        *,
        ttt_length: int,
        document_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        first_query: int = 0,
        probe: Callable[[int, torch.Tensor], None] | None = None,
    ) -> TTTOutput:
        """K = `ttt_length` steps over every position (docs/design.md §4): aux [B, T, n*Ht]; input_ids, document_ids (-1
        padding), attention_mask (1 = real), position_ids (RoPE) [B, T]. Outputs [B, Tq, H]: queries from `first_query`
        on; `probe(k, probs)`: step k's attention [B, nh, Tq, S], keys step-major (T of step 0, Tq a later step)."""
        if ttt_length < 1:
            raise ValueError(f"ttt_length must be >= 1, got {ttt_length}")
        B, T = input_ids.shape
        docs = segment_ids(document_ids, attention_mask, (B, T), input_ids.device)
        index = torch.arange(T, device=input_ids.device).expand(B, T)  # the position p of each row
        positions = index if position_ids is None else position_ids
        rows = slice(first_query, T)
        feature = self.fuse_aux(aux)  # [B, T, H]
        keys, values, key_coords, states, hidden = [], [], [], [], []
        for k in range(ttt_length):
            seen = slice(None) if k == 0 else rows  # whose step-k keys there are: every position's at step 0
            tokens = shift_left(input_ids, 1 + k)[:, seen]  # x[p+1+k]
            if k and self.config.parallel_drafting:
                feature, tokens = self.mask_slots(tokens.shape, tokens.device)
            q, key, value, residual = self.step_qkv(feature, tokens, positions[:, seen] + k)
            if k == 0:
                q, residual = q[:, rows], residual[:, rows]
            keys.append(key)
            values.append(value)
            key_coords.append((docs[:, seen], index[:, seen], torch.full_like(index[:, seen], k)))
            key_doc, key_pos, key_step = (torch.cat(c, 1)[:, None] for c in zip(*key_coords))
            allowed = self.visibility(docs[:, rows, None], index[:, rows, None], k, key_doc, key_pos, key_step)
            step_probe = None if probe is None else lambda probs, k=k: probe(k, probs)
            attn = explicit_attention(q, torch.cat(keys, 1), torch.cat(values, 1), allowed, step_probe)
            out = self.step_output(residual, attn)
            states.append(out.state)
            hidden.append(out.hidden)
            feature = out.feature
        return TTTOutput(states=states, hidden=hidden, segments=docs)

    def compile_blocks(self) -> None:
        """torch.compile the RMSNorms and the MLP in place (CUDA: fuses the pointwise work around the matmuls)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, MLP)):
                module.compile()

    def save(self, path: str | Path, include_embed: bool = True) -> None:
        """Native format: config.json + model.safetensors (written atomically)."""
        from eagle31.io import atomic_save_safetensors, atomic_write_json

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        if not include_embed:
            state.pop("embed_tokens.weight")
        atomic_save_safetensors(state, path / "model.safetensors", save_file)
        meta = {"format": NATIVE_FORMAT, "format_version": NATIVE_FORMAT_VERSION, "drafter": self.config.to_dict()}
        atomic_write_json(path / "config.json", meta)

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu") -> Eagle31Drafter:
        """A drafter `save` wrote (no embedding saved: zeros, load the target's); a mismatch: one-line `ConfigError`."""
        path = Path(path)
        meta = read_native_config(path)
        try:
            model = cls(DrafterConfig.from_dict(meta["drafter"]))
        except TypeError as e:  # a missing or mistyped field
            raise ConfigError(f"{path / 'config.json'}: the drafter block is not a drafter config ({e})") from None
        state = read_safetensors(path / "model.safetensors", device)
        missing, unexpected = load_checked_state(model, state, path / "model.safetensors")
        if "embed_tokens.weight" in missing:  # saved without it: zeros until the target's is loaded
            missing.remove("embed_tokens.weight")
            model.embed_tokens.weight.data.zero_()
        if missing or unexpected:
            raise ConfigError(f"{path}/model.safetensors: missing keys {missing}, unexpected keys {unexpected}")
        return model.to(device)


def read_safetensors(path: Path, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file; a missing, truncated or corrupt file is a one-line ConfigError."""
    try:
        return load_file(str(path), device=str(device))
    except (SafetensorError, OSError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"{path} is not a readable safetensors file (truncated or corrupt?): {reason}") from None


# the config fields that size each tensor, by name fragment (first match)
_SIZED_BY = (
    ("embed_tokens", "vocab_size, hidden_size"),
    ("fc_norm", "target_hidden_size"),
    ("input_norm", "target_hidden_size, aux_layer_ids"),
    ("fc.", "hidden_size, target_hidden_size, aux_layer_ids"),
    ("lm_head", "draft_vocab_size, hidden_size"),
    ("d2t", "draft_vocab_size"),
    ("t2d", "vocab_size"),
    ("self_attn", "hidden_size, num_attention_heads, num_key_value_heads, head_dim"),
    ("mlp", "hidden_size, intermediate_size"),
    ("", "hidden_size"),
)


def load_checked_state(model: nn.Module, state: dict[str, torch.Tensor], source: str | Path):
    """`load_state_dict(state, strict=False)` -> (missing, unexpected), shapes checked first: a mismatch is one line."""
    expected = model.state_dict()
    for key, tensor in state.items():
        if key in expected and tuple(tensor.shape) != tuple(expected[key].shape):
            fields = next(f for fragment, f in _SIZED_BY if fragment in key)
            raise ConfigError(
                f"{source}: {key} has shape {tuple(tensor.shape)} but the config.json beside it ({fields}) "
                f"makes it {tuple(expected[key].shape)}; the config does not match the weights"
            )
    return model.load_state_dict(state, strict=False)


def read_native_config(path: Path) -> dict:
    cfg_path = path / "config.json"
    meta = read_json_config(cfg_path, "drafter config")
    if meta.get("format") != NATIVE_FORMAT:
        raise ConfigError(f"{cfg_path} is not an eagle31 native drafter (format={meta.get('format')!r})")
    if not isinstance(meta.get("drafter"), dict):
        raise ConfigError(f"{cfg_path} has no 'drafter' block (the drafter's settings); it was cut or hand-edited")
    return meta
