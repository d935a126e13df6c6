"""The memory estimate checked against real training steps: `eagle31.estimate` term by term.

    python -m benchmarks.memory_model                  # the committed run (CPU, a few minutes)
    python -m benchmarks.memory_model size=tiny out=none   # seconds (the test)
    # the estimate again, against the same measurements:
    python -m benchmarks.memory_model measured=benchmarks/results/memory_model.json

Keys (key=value; a bad one is a one-line error, exit 2):
    size=full|tiny       the shapes below (full) or one tiny MLA shape (tiny)
    out=<path>.json|none where the JSON goes (the markdown table beside it); none: print only
    measured=<path>|none take that earlier result's measurements instead of measuring

Each point is two full `Trainer.train_step`s (TTT unroll, loss, backward, clipping, AdamW) in
a fresh process on CPU (fp32, one plain process: the estimate's `device="cpu"`, whose step is traced on
the meta device as the CPU runs it, `eagle31.memory_trace`). What the tensors hold is counted by
`benchmarks.measure.LiveTensorBytes`; each term of the estimate is set beside the bytes that term names:

  weights_and_optimizer_states  trainable parameters + what stays alive after a step (AdamW's moments)
  frozen_embedding, target_lm_head, target_features   the built tensors' bytes
  training_step                 the second step's peak of what its tensors hold besides what a step leaves
                                alive (the gradients formed by then included)
  total                         the built model, the batch and the second step's peak
  per-token slope               how the step grows with T: the least-squares slope over the shape's T (three
                                where checked; not checked where that growth is a few KB on a fixed-size step)

Shapes: the Kimi K2.6 attention shapes (MLA 64 heads x (128 + 64), latents 512 + 64, q rank
1536; Llama 64 x 128) at a reduced hidden size, MLP width and vocabulary for the per-token
terms, and the full 163,840-token vocabulary at a small width for the vocabulary terms. A
point passes when every term, the total and the slope are within 1% (`TOLERANCE`). Results: JSON and a
markdown table under benchmarks/results/ (out=; out=none to skip); docs/performance.md
summarises them.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.measure import LiveTensorBytes, cpu_step_memory
from benchmarks.report import write_result
from benchmarks.train_step import BenchConfig, EagleStep
from eagle31.errors import ConfigError
from eagle31.estimate import GiB, RunMemory
from eagle31_cli import parse_key_values, wants_help

ROOT = Path(__file__).resolve().parent.parent
# the traced step is the CPU step's code on the meta device: every term within 1%; on CUDA (`cuda_point`) the
# allocator's blocks and the kernels' workspace are not tensors: the total within 10%
TOLERANCE, CUDA_TOLERANCE = 0.01, 0.10

# Kimi K2.6's attention shapes at a reduced width (H, I, vocabulary): the per-token terms
_KIMI_MLA = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
_KIMI_MLA_HEADS = dict(attention="mla", num_attention_heads=64, num_key_value_heads=64, head_dim=192, mla=_KIMI_MLA)
_NARROW = dict(hidden_size=512, target_hidden_size=512, intermediate_size=1024, vocab_size=2048, draft_vocab_size=1024)
SHAPES = {
    "full": {
        "mla_kimi_heads": dict(overrides={**_NARROW, **_KIMI_MLA_HEADS}, seq_lens=(128, 256, 512)),
        "llama_kimi_heads": dict(
            overrides={**_NARROW, "num_attention_heads": 64, "num_key_value_heads": 64, "head_dim": 128},
            seq_lens=(128, 256, 512),
        ),
        "llama_kimi_heads_no_ckpt": dict(
            overrides={**_NARROW, "num_attention_heads": 64, "num_key_value_heads": 64, "head_dim": 128},
            seq_lens=(128, 256, 512),
            checkpointing=False,
        ),
        # the full vocabulary (Vd = V = 163840, as kimi_k26) at a small width: the vocabulary terms
        "mla_full_vocab": dict(
            overrides={
                **_KIMI_MLA_HEADS,
                "hidden_size": 128,
                "target_hidden_size": 128,
                "intermediate_size": 256,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "mla": {**_KIMI_MLA_HEADS["mla"], "q_lora_rank": 64, "kv_lora_rank": 32},
                "vocab_size": 163840,
                "draft_vocab_size": 163840,
            },
            seq_lens=(128, 256),
            # its working set is the loss's fixed-size chunk (rows x V), the per-token part a few KB on
            # 0.5 GiB: a slope ratio is noise there, the absolute term at each T is the check
            slope_checked=False,
        ),
    },
    "tiny": {
        "mla_tiny": dict(
            overrides=dict(
                attention="mla",
                hidden_size=64,
                num_attention_heads=4,
                num_key_value_heads=4,
                head_dim=24,
                mla=dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
                intermediate_size=128,
                vocab_size=512,
                draft_vocab_size=256,
            ),
            seq_lens=(128, 256),
        ),
        # a parallel (P-EAGLE) drafter: its steps k >= 1 read the mask slots (fuse_aux of mask_hidden)
        "llama_tiny_parallel": dict(
            overrides=dict(
                hidden_size=64,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                intermediate_size=128,
                vocab_size=512,
                draft_vocab_size=256,
                parallel_drafting=True,
                mask_token_id=0,
            ),
            seq_lens=(128, 256),
        ),
    },
}
TTT_LENGTH = 3


def measure_point(overrides: dict, seq_len: int, checkpointing: bool) -> dict:
    """One point's measured bytes, from a fresh process (`_terms_child`)."""
    bench = BenchConfig(
        shape="tiny",
        seq_len=seq_len,
        ttt_length=TTT_LENGTH,
        overrides=overrides,
        activation_checkpointing=checkpointing,
        threads=1,
        device="cpu",
        precision="fp32",
    )
    return cpu_step_memory("eagle31", bench, child="benchmarks.memory_model:_terms_child")


def _terms_child(spec: str) -> None:
    """Body of `measure_point`'s process: build, then two steps under `LiveTensorBytes`."""
    args = json.loads(spec)
    bench = BenchConfig(**args["bench"])
    torch.set_num_threads(bench.threads)
    step = EagleStep(bench)
    drafter, head, batch = step.trainer.model.drafter, step.trainer.target, step.batch
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    grads: dict[int, int] = {}
    for p in trainable:  # each gradient's bytes, as autograd accumulates it
        p.register_post_accumulate_grad_hook(lambda p: grads.__setitem__(id(p), p.grad.nbytes))
    storages = {head.weight.untyped_storage().data_ptr(): head.weight.nbytes}
    storages[head.draft_weight.untyped_storage().data_ptr()] = head.draft_weight.nbytes
    gc.collect()
    with LiveTensorBytes() as tensors:
        step()
        persistent = tensors.live  # AdamW's moments (the gradients are set to None after the step)
        grads.clear()
        tensors.reset_peak()
        step()
    print(
        json.dumps(
            {
                "trainable_bytes": sum(p.nbytes for p in trainable),
                "gradient_bytes": sum(grads.values()),
                "persistent_bytes": persistent,
                "frozen_embedding_bytes": drafter.embed_tokens.weight.nbytes,
                "target_lm_head_bytes": sum(storages.values()) + head.in_draft.nbytes,
                "target_features_bytes": batch.aux.nbytes + batch.final.nbytes,
                "step_peak_bytes": tensors.peak,
            }
        )
    )


def cuda_point(overrides: dict, seq_len: int, checkpointing: bool) -> dict:
    """One point on CUDA (bf16, FSDP2 on one GPU, as trained): `torch.cuda.max_memory_allocated` over two
    steps, absolute (the built model included), beside the estimate's total for `device="cuda"` (on GPUs the
    causal kernel runs its CUDA path, which the estimate counts from `eagle31.kernels.flash_cuda`)."""
    bench = BenchConfig(
        shape="tiny",
        seq_len=seq_len,
        ttt_length=TTT_LENGTH,
        overrides=overrides,
        activation_checkpointing=checkpointing,
        device="cuda",
        precision="bf16",
    )
    device = bench.torch_device()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    step = EagleStep(bench)
    step()
    step()
    peak = torch.cuda.max_memory_allocated(device) / GiB
    est = RunMemory(bench.drafter_config(), TTT_LENGTH, activation_checkpointing=checkpointing).at(seq_len)
    del step
    gc.collect()
    torch.cuda.empty_cache()
    return {
        "seq_len": seq_len,
        "measured_gib": peak,
        "estimated_gib": est["total"],
        "estimate_over_measured": est["total"] / peak,
        "estimated_terms_gib": est,
    }


def compare(name: str, spec: dict, log=lambda line: None, recorded: dict | None = None) -> dict:
    """Measure every T of one shape (or take `recorded` measurements, T -> raw) and set the estimate beside it."""
    checkpointing = spec.get("checkpointing", True)
    cfg = BenchConfig(shape="tiny", overrides=spec["overrides"]).drafter_config()
    points = []
    for T in spec["seq_lens"]:
        t0 = time.perf_counter()
        m = recorded[T] if recorded else measure_point(spec["overrides"], T, checkpointing)
        est = RunMemory(cfg, TTT_LENGTH, activation_checkpointing=checkpointing, compute_bytes=4, device="cpu").at(T)
        measured = {
            "weights_and_optimizer_states": m["trainable_bytes"] + m["persistent_bytes"],
            "frozen_embedding": m["frozen_embedding_bytes"],
            "target_lm_head": m["target_lm_head_bytes"],
            "target_features": m["target_features_bytes"],
            "training_step": m["step_peak_bytes"] - m["persistent_bytes"],
        }
        # the true peak: the model, what a step leaves alive, and the second step's peak above it
        peak = (
            m["trainable_bytes"] + m["frozen_embedding_bytes"] + m["target_lm_head_bytes"] + m["target_features_bytes"]
        )
        measured = {k: v / GiB for k, v in measured.items()}
        measured["total"] = (peak + m["step_peak_bytes"]) / GiB
        estimated = {k: est[k] for k in measured}
        ratios = {k: estimated[k] / measured[k] if measured[k] else None for k in measured}
        seconds = round(time.perf_counter() - t0, 1)
        point = {"seq_len": T, "measured_gib": measured, "estimated_gib": estimated, "estimate_over_measured": ratios}
        points.append({**point, "raw": m, "seconds": seconds})
        log(
            f"{name} T={T}: measured {measured['total']:.3f} GiB, estimated {estimated['total']:.3f} GiB "
            f"(the step {measured['training_step']:.3f} vs {estimated['training_step']:.3f})"
        )
    slope = {side: working_set_slope(points, side) for side in ("measured", "estimated")}
    checks = {}
    for p in points:
        for k, r in p["estimate_over_measured"].items():
            if r is not None:
                checks[f"T={p['seq_len']} {k}"] = abs(r - 1) <= TOLERANCE
    if spec.get("slope_checked", True):
        checks["per-token slope"] = abs(slope["estimated"] / slope["measured"] - 1) <= TOLERANCE
    return {
        "shape": name,
        "overrides": spec["overrides"],
        "activation_checkpointing": checkpointing,
        "ttt_length": TTT_LENGTH,
        "points": points,
        "bytes_per_token": slope,
        "checks": checks,
        "passed": all(checks.values()),
    }


def working_set_slope(points: list[dict], side: str) -> float:
    """Bytes per token: the least-squares slope of `side`'s ("measured" or "estimated") training step over
    the points' T (with two points, their difference over their distance)."""
    Ts = [p["seq_len"] for p in points]
    ws = [p[f"{side}_gib"]["training_step"] * GiB for p in points]
    T_mean, w_mean = sum(Ts) / len(Ts), sum(ws) / len(ws)
    return sum((T - T_mean) * (w - w_mean) for T, w in zip(Ts, ws)) / sum((T - T_mean) ** 2 for T in Ts)


def markdown(result: dict) -> str:
    rows = [
        "| shape | T | term | measured GiB | estimated GiB | estimate / measured |",
        "|---|---|---|---|---|---|",
    ]
    for s in result["shapes"]:
        for p in s["points"]:
            for k, v in p["measured_gib"].items():
                r = p["estimate_over_measured"][k]
                rows.append(
                    f"| {s['shape']} | {p['seq_len']} | {k} | {v:.4f} | {p['estimated_gib'][k]:.4f} | "
                    f"{'-' if r is None else f'{r:.3f}'} |"
                )
        b = s["bytes_per_token"]
        rows.append(
            f"| {s['shape']} | slope | bytes per token | {b['measured']:,.0f} | {b['estimated']:,.0f} | "
            f"{b['estimated'] / b['measured']:.3f} |"
        )
    return "\n".join(rows) + "\n"


@dataclass
class MemoryModelArgs:
    """The command line's keys (module docstring)."""

    size: str = "full"
    out: str = str(ROOT / "benchmarks" / "results" / "memory_model.json")
    measured: str = "none"


def main(argv: list[str]) -> int:
    if wants_help(argv, __doc__):
        return 0
    try:
        args = parse_key_values(argv, MemoryModelArgs)
        if args.size not in SHAPES:
            raise ConfigError(f"size={args.size!r}; choose one of {sorted(SHAPES)}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    def log(line: str) -> None:
        print(line, file=sys.stderr)

    recorded = {}  # measured=<json>: the estimate again, against that file's measurements
    if args.measured != "none":
        earlier = json.loads(Path(args.measured).read_text())
        recorded = {s["shape"]: {p["seq_len"]: p["raw"] for p in s["points"]} for s in earlier["shapes"]}
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "device": "cpu, fp32, one process, 1 thread",
        "tolerance": {"term": TOLERANCE, "cuda_total": CUDA_TOLERANCE},
        "shapes": [compare(name, spec, log, recorded.get(name)) for name, spec in SHAPES[args.size].items()],
    }
    result["passed"] = all(s["passed"] for s in result["shapes"])
    table = markdown(result)
    if args.out != "none":
        out = write_result(result, args.out)
        Path(out).with_suffix(".md").write_text(table)
        log(f"wrote {out} and {Path(out).with_suffix('.md')}")
    print(table)
    failed = [f"{s['shape']}: {k}" for s in result["shapes"] for k, ok in s["checks"].items() if not ok]
    if failed:
        print("outside the tolerance: " + "; ".join(failed), file=sys.stderr)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
