"""The EAGLE 3.1 drafter (docs/design.md §3), with Hugging Face parameter names.

Reads top to bottom: norm → MLP → decoder layer → drafter; the attention
projections and the rope are the attention kind's (`eagle31.attention`:
Llama's q/k/v, DeepSeek's MLA). Parameter names are the checkpoint format (`fc`, `fc_norm.i`,
`midlayer.self_attn.q_proj`, ...), so export is a rename table. This module
defines one drafter step — the fused step-0 feature (`fuse_aux`), the layer on
either side of attention (`step_qkv`, `step_output`) and the feedback rule of
`norm_output` (`read_out`) — which `eagle31.ttt` unrolls over K steps in
training and `eagle31.eval.drafting` runs against its KV cache at inference.
`eagle31.kernels` holds the TTT attention and its kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from eagle31.config import DrafterConfig, read_json_config
from eagle31.errors import ConfigError
from eagle31.kernels.entries import ChainKeysValues
from eagle31.ttt import ttt_unroll

NATIVE_FORMAT = "eagle31-drafter"
NATIVE_FORMAT_VERSION = 1


class RMSNorm(nn.Module):
    """weight * (x * rsqrt(mean(x^2) + eps)), normalised in fp32 and rounded to x's dtype before the weight.

    Its backward recomputes the normalised x from x and the saved per-row rsqrt (`_RMSNormFunction`):
    it saves x (which its caller usually keeps anyway), not fp32 copies of x and of its output.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps)


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


class MLP(nn.Module):
    """SwiGLU feed-forward: down(act(gate(x)) * up(x))."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        H, I = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)
        if config.hidden_act != "silu":
            raise ConfigError(f"drafter.hidden_act={config.hidden_act!r} is not supported (only 'silu')")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    """The drafter's one decoder layer (docs/design.md §3), split around attention.

        r   = hidden_norm(h) if norm_before_residual else h
        z   = concat(input_layernorm(emb), hidden_norm(h))          # [*, 2H]
        h'  = r + o_proj(Attn(q_proj(z), k_proj(z), v_proj(z)))
        out = h' + mlp(post_attention_layernorm(h'))

    The attention projections are the attention kind's (`config.kind.attention`: Llama's q/k/v,
    DeepSeek's MLA); every kind's read the 2H-wide z.
    """

    def __init__(self, config: DrafterConfig):
        super().__init__()
        H, eps = config.hidden_size, config.rms_norm_eps
        self.norm_before_residual = config.norm_before_residual
        self.input_layernorm = RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.self_attn = config.kind.attention(config, RMSNorm)
        self.mlp = MLP(config)

    def pre_attention(
        self, emb: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, entry: bool = True
    ):
        """emb, h [B, T, H] -> (q, entry, residual); the attention's `keys_values(*entry)` gives k, v.
        `entry=False` (Llama attention): q alone, the entry None."""
        h_normed = self.hidden_norm(h)
        residual = h_normed if self.norm_before_residual else h
        z = torch.cat([self.input_layernorm(emb), h_normed], dim=-1)
        if not entry:
            return self.self_attn.query(z, cos, sin), None, residual
        q, kept = self.self_attn.query_entry(z, cos, sin)
        return q, kept, residual

    def attention_input(
        self, emb: torch.Tensor, h: torch.Tensor, input_norm_weight, hidden_norm_weight
    ) -> torch.Tensor:
        """z = concat(input_layernorm(emb), hidden_norm(h)) [*, 2H], with the given norm weights."""
        eps = self.input_layernorm.eps
        return torch.cat(
            [_RMSNormFunction.apply(emb, input_norm_weight, eps), _RMSNormFunction.apply(h, hidden_norm_weight, eps)],
            -1,
        )

    def post_attention(self, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """attn [B, T, nh, d] -> layer output [B, T, H]."""
        return self.feed_forward(self.attention_residual(residual, attn))

    def attention_residual(self, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """h' = residual + o_proj(attn), [B, T, H]."""
        return residual + self.self_attn.output(attn)

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        """h' -> h' + mlp(post_attention_layernorm(h')): position by position, [*, H]."""
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass
class DraftStep:
    """What one drafter step gives, each [B, T, H]."""

    hidden: torch.Tensor  # o: the decoder layer's output (pre-norm)
    state: torch.Tensor  # norm(o): what lm_head reads
    feature: torch.Tensor  # what the next step reads: norm(o) with `norm_output` (EAGLE 3.1), o otherwise


class Eagle31Drafter(nn.Module):
    """EAGLE 3 drafter with the EAGLE 3.1 switches (`fc_norm`, `norm_output`).

    Buffers `d2t [Vd]` (int64 offsets: target id = i + d2t[i]) and
    `t2d [V]` (bool: target id is in the draft vocabulary) map vocabularies.
    """

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
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.t2d[: config.draft_vocab_size] = True
        self.reset_parameters()

    # --------------------------------------------------------------- init

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """Llama-style init: linears N(0, std), norms ones (fc_norm starts at ones)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    @torch.no_grad()
    def init_from_target(
        self,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        d2t: torch.Tensor,
        t2d: torch.Tensor,
    ) -> None:
        """Copy the target's embedding (frozen) and its lm_head rows at the draft vocabulary.

        embed_weight, lm_head_weight: [V, Ht]; d2t [Vd] offsets; t2d [V] bool.
        """
        cfg = self.config
        if tuple(embed_weight.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ConfigError(
                f"target embedding has shape {tuple(embed_weight.shape)}, drafter expects "
                f"({cfg.vocab_size}, {cfg.hidden_size})"
            )
        if tuple(lm_head_weight.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise ConfigError(
                f"target lm_head has shape {tuple(lm_head_weight.shape)}, drafter expects "
                f"({cfg.vocab_size}, {cfg.hidden_size})"
            )
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

    def forward(
        self,
        aux: torch.Tensor,
        input_ids: torch.Tensor,
        *,
        ttt_length: int = 1,
        document_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        attention_kernel: str = "auto",
    ) -> list[torch.Tensor]:
        """Per-step draft logits, each [B, T, Vd]; step k at position p is query (p, k) of docs/design.md §4.

        aux [B, T, n*Ht], input_ids [B, T]; see `eagle31.ttt.ttt_unroll`.
        """
        out = ttt_unroll(
            self,
            aux,
            input_ids,
            ttt_length=ttt_length,
            document_ids=document_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            attention_kernel=attention_kernel,
        )
        return [self.lm_head(s) for s in out.states]

    # ---------------------------------------------------------- one drafter step
    # A step is split around attention, the one part training and inference do differently:
    # training attends with the TTT mask over K steps, inference with its KV cache or tree mask.

    def fuse_aux(self, aux: torch.Tensor) -> torch.Tensor:
        """Step-0 feature: aux [B, T, n*Ht] -> fc(fc_norm(aux)) [B, T, H]."""
        if self.fc_norm is not None:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks)], dim=-1)
        elif self.input_norm is not None:
            aux = self.input_norm(aux)
        return self.fc(aux)

    def step_entry(self, feature: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, *, chain: bool = False):
        """The step up to attention: feature [B, T, H] (`fuse_aux` at step 0, the previous
        `DraftStep.feature` after), tokens and RoPE positions [B, T] -> (q, entry, residual),
        the entry being what `keys_values` makes this step's keys and values of (Llama: they
        themselves; MLA: its latents).

        chain=True: the entry the TTT chain keeps of this step for the later ones instead
        (`chain_keys_values` makes keys and values of it a block of tokens at a time): MLA's
        latents again; for Llama attention the step's input (feature, tokens, positions), which
        the unroll keeps anyway — 0 bytes more instead of 2 * nkv * d per token.
        """
        emb = self._embed(tokens, feature.dtype)
        cos, sin = self.rotary_emb(positions, feature.dtype)
        if chain and self.config.kind.chain_keeps_input:
            q, _, residual = self.midlayer.pre_attention(emb, feature, cos, sin, entry=False)
            return q, (feature, tokens, positions), residual
        return self.midlayer.pre_attention(emb, feature, cos, sin)

    def _embed(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        with torch.no_grad():  # the target's embedding, frozen
            return self.embed_tokens(tokens).to(dtype)  # [*, H]

    def step0_keys_values(self) -> ChainKeysValues:
        """How the TTT attention makes the causal (step-0) keys and values of the step-0 entry: MLA
        decompresses its latents (inside the attention, so they are not saved); Llama's are the entry."""
        return self.midlayer.self_attn.step0_keys_values()

    def chain_keys_values(self) -> ChainKeysValues:
        """How the TTT chain makes keys and values of the entries `step_entry(..., chain=True)` gives."""
        if not self.config.kind.chain_keeps_input:
            return self.midlayer.self_attn.chain_keys_values()
        layer = self.midlayer
        attn = layer.self_attn
        weights = (layer.input_layernorm.weight, layer.hidden_norm.weight, attn.k_proj.weight, attn.v_proj.weight)
        return ChainKeysValues(self._input_keys_values, weights, width=3)

    def _input_keys_values(self, feature, tokens, positions, input_norm_weight, hidden_norm_weight, k_weight, v_weight):
        """Llama keys and values of token rows from the step's input: feature [n, H], tokens, positions [n]
        -> k, v [n, nkv, d] — what `step_entry` computes for those rows, with the given weights."""
        z = self.midlayer.attention_input(
            self._embed(tokens, feature.dtype), feature, input_norm_weight, hidden_norm_weight
        )
        cos, sin = self.rotary_emb(positions[None], feature.dtype)
        k, v = self.midlayer.self_attn.key_value(z[None], cos, sin, k_weight, v_weight)
        return k[0], v[0]

    def step_qkv(self, feature: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor):
        """`step_entry` with the entry made keys and values: (q, k, v, residual)."""
        q, entry, residual = self.step_entry(feature, tokens, positions)
        return q, *self.midlayer.self_attn.keys_values(*entry), residual

    def step_output(self, residual: torch.Tensor, attn: torch.Tensor) -> DraftStep:
        """The step after attention: residual [B, T, H], attn [B, T, nh, d] -> its `DraftStep`."""
        return self.read_out(self.midlayer.post_attention(residual, attn))

    def read_out(self, hidden: torch.Tensor, state: torch.Tensor | None = None) -> DraftStep:
        """A step's output o [B, T, H] -> o, norm(o) for lm_head and the next step's feature (docs/design.md §4).
        `state`: norm(o) when already computed (the unroll's chunked checkpointing)."""
        state = self.norm(hidden) if state is None else state
        return DraftStep(hidden=hidden, state=state, feature=state if self.config.norm_output else hidden)

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def compile_blocks(self) -> None:
        """torch.compile the RMSNorms and the MLP in place (fuses the pointwise work around the matmuls).

        The TTT attention keeps its own kernels; CUDA only — on CPU compilation does not pay here.
        """
        for module in self.modules():
            if isinstance(module, (RMSNorm, MLP)):
                module.compile()

    # ----------------------------------------------------------- save / load

    def save(self, path: str | Path, include_embed: bool = True) -> None:
        """Native format: config.json + model.safetensors (written atomically)."""
        from eagle31.io import atomic_save_safetensors, atomic_write_json

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        if not include_embed:
            state.pop("embed_tokens.weight")
        atomic_save_safetensors(state, path / "model.safetensors", save_file)
        atomic_write_json(
            path / "config.json",
            {"format": NATIVE_FORMAT, "format_version": NATIVE_FORMAT_VERSION, "drafter": self.config.to_dict()},
        )

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu") -> "Eagle31Drafter":
        """Load a drafter saved by `save`; a missing embedding stays zero (load the target's).

        A config that does not fit the weights (a hand-edited size, aux id list or draft
        vocabulary) or a truncated weights file is a one-line `ConfigError` naming the file.
        """
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
    """`model.load_state_dict(state, strict=False)` after checking every shape; a mismatch names the tensor,
    both shapes and the config fields that size it, in one line. Returns (missing, unexpected)."""
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
