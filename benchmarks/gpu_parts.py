"""The parts of the GPU check, each run in its own process by `benchmarks.gpu_check`.

Each part returns a JSON-able dict with `status` ("pass", "fail" or "skipped") and what it
measured; `smoke` selects the CPU variant (tiny shapes, fp32, gloo-free single process).

    environment   torch, CUDA, GPU, driver, which optional packages import, private-op signatures
    attention     fused attention vs the reference, forward and all gradients, at every recipe's
                  drafter shape (an MLA drafter where a recipe has one), packed documents,
                  padding, chain keys
    trainer       train/main.py under `torchrun --nproc-per-node 1` (NCCL on CUDA): train,
                  checkpoint, resume, export
    benchmark     one training-step benchmark run (`benchmarks.benchmark_train_step` arguments)
    sequence_parallel   `benchmarks.sequence_parallel`'s step at N = 1 through the sequence-parallel
                  code path beside the plain one: step time, peak memory, the losses agree; and the
                  attention of 4 shards of a sequence (the keys before a shard made block-wise) vs
                  the whole one's, at the Kimi K2.6 MLA drafter's shape
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent

# Packages whose presence the report states (import name -> what needs it).
OPTIONAL_PACKAGES = {
    "transformers": "everything",
    "hydra": "recipes",
    "safetensors": "checkpoints, export",
    "datasets": "data",
    "tokenizers": "data",
    "triton": "torch.compile, the peer's fused loss",
    "speculators": "the benchmark's peer",
    "hs_connectors": "the peer (speculators' import)",
    "openai": "the peer (speculators' import)",
    "accelerate": "the peer (speculators' import)",
    "flash_attn": "nothing (listed for the record)",
}


def environment(smoke: bool) -> dict[str, Any]:
    import torch

    from benchmarks.attention_check import private_op_problems

    report: dict[str, Any] = {
        "status": "pass",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cpu_count": os.cpu_count(),
    }
    if torch.cuda.is_available():
        report["gpu"] = torch.cuda.get_device_name(0)
        report["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        nccl = torch.cuda.nccl.version()  # a tuple; an int in older releases
        report["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        report["driver"] = _driver_version()
    elif not smoke:
        report.update(status="fail", error="no CUDA device is visible to torch")
    packages = {}
    for module, why in OPTIONAL_PACKAGES.items():
        try:
            mod = importlib.import_module(module)
            packages[module] = getattr(mod, "__version__", "imports")
        except Exception as e:  # noqa: BLE001 — any failure means "not usable here"
            packages[module] = f"missing ({why}): {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    report["packages"] = packages
    report["private_ops"] = {
        kind: private_op_problems(torch.device(kind)) or "as expected"
        for kind in (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    }
    return report


def _driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (no nvidia-smi)"


def attention(smoke: bool) -> dict[str, Any]:
    """Every recipe shape (and TINY in the smoke) through `check_attention_parity`."""
    import torch

    from benchmarks.attention_check import check_attention_parity, fused_backends, private_op_problems
    from benchmarks.shapes import recipe_shapes
    from eagle31.attention import DrafterAttention

    device = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    problems = private_op_problems(device)
    backends = tuple(b for b in fused_backends(device, dtype) if not (problems and b == "flash"))
    shapes = {name: shape.drafter for name, shape in recipe_shapes().items()}
    attention_types = {name: shape.attention for name, shape in recipe_shapes().items()}
    report: dict[str, Any] = {"status": "pass", "dtype": str(dtype).removeprefix("torch."), "shapes": {}}
    if problems:
        report["flash"] = "not run: " + "; ".join(problems)
    if DrafterAttention.mla not in attention_types.values():
        report["mla"] = "not available: no recipe has drafter.attention=mla"
    for name, cfg in shapes.items():
        entry: dict[str, Any] = {"attention": attention_types[name]}
        try:
            entry["max_error"] = check_attention_parity(
                cfg, device, dtype, seq_len=64 if smoke else 1024, backends=backends
            )
            entry["status"] = "pass"
        except Exception as e:  # noqa: BLE001 — one shape failing must not hide the others
            entry.update(status="fail", error=f"{type(e).__name__}: {e}"[:2000])
            report["status"] = "fail"
        report["shapes"][name] = entry
    return report


def trainer(smoke: bool, out: Path) -> dict[str, Any]:
    """Two `torchrun --nproc-per-node 1` runs of the mini Kimi recipe (its MLA drafter): 2 steps, then resumed to 4,
    with the recipe's exports."""
    work = out / "trainer"
    work.mkdir(parents=True, exist_ok=True)
    chats = work / "chats.jsonl"
    chats.write_text("".join(json.dumps(tiny_chat(i)) + "\n" for i in range(48)))
    run_dir = work / "run"
    device = ["train.device=cpu", "train.precision=fp32"] if smoke else ["train.device=cuda", "train.precision=bf16"]
    problems = _flash_problems("cpu" if smoke else "cuda")
    if problems:  # this torch's fused ops differ from what eagle31 calls: train on the blockwise kernel
        device.append("train.attention_kernel=blockwise")
    base = [
        "recipe=kimi_k26_mini",
        f"data.source=[{chats}]",
        "data.max_len=128",
        "data.eval_fraction=0.1",
        "drafter.draft_vocab_size=128",
        "features.tokens_per_batch=256",
        "train.save_every=2",
        "train.log_every=1",
        "logging.progress=false",
        f"output_dir={run_dir}",
        *device,
    ]
    with tempfile.TemporaryDirectory(prefix="eagle31-gpu-check-cache-") as cache:
        env = {**child_env(), "EAGLE31_CACHE": cache, "PYTHONUNBUFFERED": "1"}
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "1",
            str(ROOT / "train" / "main.py"),
        ]
        runs = {}
        for name, extra in (("first", ["train.max_steps=2"]), ("resumed", ["train.max_steps=4", "resume=auto"])):
            proc = subprocess.run([*cmd, *base, *extra], capture_output=True, text=True, env=env, cwd=ROOT)
            (work / f"{name}.log").write_text(proc.stdout + proc.stderr)
            runs[name] = proc
            if proc.returncode != 0:
                return {"status": "fail", "error": f"{name} run exited {proc.returncode}: {proc.stderr[-1500:]}"}
    report = json.loads((run_dir / "report.json").read_text())
    checks = {
        "resumed": "resumed from" in runs["resumed"].stdout,
        "steps": report.get("steps") == 4,
        "checkpoints": (run_dir / "checkpoints" / "step_00000004").is_dir(),
    }
    formats = yaml.safe_load((run_dir / "config.yaml").read_text())["export"]["formats"]  # the recipe's (MLA: eagle3)
    checks.update({f"export_{fmt}": (run_dir / "export" / fmt / "config.json").is_file() for fmt in formats})
    result = {"status": "pass" if all(checks.values()) else "fail", "checks": checks, "device": device[0]}
    if problems:
        result["flash"] = "not run (trained with train.attention_kernel=blockwise): " + "; ".join(problems)
    result["tokens_per_s"] = _last_metric(run_dir, "train/tokens_per_s")
    return result


def _flash_problems(device_type: str) -> list[str]:
    import torch

    from benchmarks.attention_check import private_op_problems

    return private_op_problems(torch.device(device_type))


def tiny_chat(i: int) -> dict:
    """Conversation `i` of the tiny chat data the smoke parts train on."""
    a, b = i % 7, i % 5
    return {
        "messages": [
            {"role": "user", "content": f"What is {a} plus {b}? Tell me about the weather."},
            {"role": "assistant", "content": f"It is {a + b}. The weather is sunny and warm, with a light wind."},
        ]
    }


def _last_metric(run_dir: Path, key: str) -> float | None:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    values = [x[key] for x in lines if key in x]
    return values[-1] if values else None


def child_env() -> dict[str, str]:
    """This process's environment with the repository first on PYTHONPATH, so children import this checkout."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}


def benchmark(args: list[str]) -> dict[str, Any]:
    """One `benchmark_train_step` run; the peer running out of memory (or failing) is a result, ours is not."""
    from benchmarks.measure import run_benchmark
    from benchmarks.train_step import BenchConfig
    from eagle31.distributed import close_world

    bench = BenchConfig.from_args(args)
    problems = _flash_problems(bench.torch_device().type)
    if problems and bench.attention == "auto":  # measure the blockwise kernel rather than nothing
        bench = BenchConfig.from_args([*args, "attention=blockwise"])
    try:
        result = run_benchmark(bench, log=lambda line: print(line, file=sys.stderr, flush=True))
    finally:
        close_world()
    if problems:
        result["flash"] = "not run (measured with the blockwise kernel): " + "; ".join(problems)
    ours = result["runs"]["eagle31"]
    result["status"] = "fail" if "error" in ours else "pass"
    if "error" in ours:
        result["error"] = ours["error"]
    return result


def memory(smoke: bool) -> dict[str, Any]:
    """The memory model's points (`benchmarks.memory_model`): on CUDA the absolute peak of two steps per
    shape and T beside the estimate's total; on CPU (`--cpu-smoke`) the tiny shape, term by term."""
    import torch

    from benchmarks import memory_model
    from eagle31.distributed import close_world

    if smoke or not torch.cuda.is_available():
        shapes = {name: memory_model.compare(name, spec) for name, spec in memory_model.SHAPES["tiny"].items()}
        status = "pass" if all(s["passed"] for s in shapes.values()) else "fail"
        return {
            "status": status,
            "device": "cpu",
            "detail": f"{len(shapes)} shape(s) term by term",
            "memory_shapes": shapes,
        }
    points = {}
    try:
        for name, spec in memory_model.SHAPES["full"].items():
            points[name] = [
                memory_model.cuda_point(spec["overrides"], T, spec.get("checkpointing", True)) for T in spec["seq_lens"]
            ]
    finally:
        close_world()
    within = all(
        abs(p["estimate_over_measured"] - 1) <= memory_model.CUDA_TOLERANCE for ps in points.values() for p in ps
    )
    detail = "totals within 10%" if within else "a total off by more than 10% (points)"
    return {"status": "pass", "device": "cuda", "detail": detail, "total_within_tolerance": within, "points": points}


def sequence_parallel(smoke: bool) -> dict[str, Any]:
    """`benchmarks.sequence_parallel`'s step at N = 1 (one process, NCCL on CUDA, gloo on CPU) through the
    sequence-parallel code path (shard, halo, gathered step-0 keys) beside the plain path at the same
    shape: step time, peak memory, exchanged bytes, their ratios, and the two losses (which must agree).
    N = 1 has no keys before its shard: `shard_attention` runs those kernels, on one process."""
    import gc
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from benchmarks.measure import LiveTensorBytes
    from benchmarks.sequence_parallel import Traffic, training_step
    from eagle31.distributed import World, close_world, ensure_single_process_group
    from eagle31.sequence_parallel import SequenceGroup

    device = torch.device("cpu") if smoke else torch.device("cuda", 0)
    dtype = torch.float32 if smoke else torch.bfloat16
    spec = {
        "attention": "mla",
        "seq_len": 64 if smoke else 32768,
        "backend": "blockwise" if _flash_problems(device.type) else "flash",
    }
    warmup, repeats = (1, 1) if smoke else (2, 5)
    world = World(rank=0, world_size=1, local_rank=0, device=device)
    ensure_single_process_group(device)
    traffic = Traffic()
    paths = {"plain": SequenceGroup(1, 0, 0, 1), "sequence_parallel": SequenceGroup(1, 0, 0, 1, dist.group.WORLD)}
    runs: dict[str, dict[str, Any]] = {}  # reported as "paths": "runs" are the training-step benchmark's
    try:
        for name, group in paths.items():  # one at a time: each peak is its own
            step = training_step(spec, world, group, dtype)
            for _ in range(warmup):
                loss = step()
            times = []
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            before = traffic.bytes
            for _ in range(repeats):
                t0 = time.perf_counter()
                loss = step()
                float(loss)  # waits for the device
                times.append(time.perf_counter() - t0)
            exchanged = (traffic.bytes - before) // repeats
            if device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(device)
            else:  # the tensors one more step makes (not timed: counting them slows it)
                with LiveTensorBytes() as tensors:
                    step()
                peak = tensors.peak
            runs[name] = {
                "step_s": statistics.median(times),
                "peak_bytes": peak,
                "loss": float(loss),
                "exchanged_bytes_per_step": exchanged,
            }
            del step
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        close_world()
    plain, split = runs["plain"], runs["sequence_parallel"]
    loss_difference = abs(split["loss"] - plain["loss"]) / abs(plain["loss"])
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    # the keys before a shard (`QueryTail`), which N = 1 has none of: the Kimi K2.6 MLA drafter's attention
    from benchmarks.sequence_parallel import drafter_config
    from benchmarks.shapes import recipe_drafter

    mla = drafter_config("mla", 64) if smoke else recipe_drafter("kimi_k26")
    shards = shard_attention(mla, 64 if smoke else 16384, 4, device, dtype, spec["backend"])
    ok = loss_difference <= tolerance and split["exchanged_bytes_per_step"] > 0 and shards["passed"]
    report = {
        "status": "pass" if ok else "fail",
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "seq_len": spec["seq_len"],
        "backend": spec["backend"],
        "paths": runs,
        "step_ratio": split["step_s"] / plain["step_s"],
        "peak_ratio": split["peak_bytes"] / plain["peak_bytes"],
        "loss_relative_difference": loss_difference,
        "shard_attention": shards,
    }
    report["detail"] = (
        f"N=1 through the sequence-parallel path vs plain, T={spec['seq_len']}: step x{report['step_ratio']:.2f}, "
        f"peak x{report['peak_ratio']:.2f}, loss differs by {loss_difference:.1e}; last of {shards['shards']} shards' "
        f"attention at T={shards['seq_len']} ({shards['heads']} heads): "
        f"max error {max(shards['max_error'].values()):.1e}, "
        f"{shards['last_shard_s'] * 1e3:.0f} ms vs {shards['whole_s'] * 1e3:.0f} ms whole"
    )
    if not ok:
        report["error"] = report["detail"] + (
            "" if split["exchanged_bytes_per_step"] else "; no collective ran (not the sequence-parallel path)"
        )
    return report


def shard_attention(cfg, seq_len: int, parts: int, device, dtype, backend: str) -> dict[str, Any]:
    """The MLA TTT attention (step 0's latents and two chain steps) of one document of `seq_len` tokens
    split into `parts` shards, each shard's queries with the latents of every position up to its end
    (`QueryTail`: the keys before it decompressed a block at a time), against the whole sequence's:
    output and every gradient (summed over the shards where they share positions), fwd + bwd time
    and peak memory of the last shard (the longest prefix) and of the whole."""
    import time
    from functools import partial

    import torch

    from eagle31.attention.mla import mla_keys_values
    from eagle31.kernels.entries import ChainKeysValues
    from eagle31.kernels.ttt_attention import ttt_attention_of_entries
    from eagle31.model import segment_ids

    nh, nope, rope, v_dim, rank = (
        cfg.num_attention_heads,
        cfg.mla.qk_nope_head_dim,
        cfg.mla.qk_rope_head_dim,
        cfg.mla.v_head_dim,
        cfg.mla.kv_lora_rank,
    )
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g) * scale).to(device, dtype)  # noqa: E731
    q, dout = rand(1, seq_len, nh, nope + rope), rand(1, seq_len, nh, nope + rope)
    latents, weight = (
        [rand(1, seq_len, rank + rope) for _ in range(3)],
        rand(nh * (nope + v_dim), rank, scale=rank**-0.5),
    )
    segments = segment_ids(None, None, (1, seq_len), device=device)  # one document across every shard
    cuda = device.type == "cuda"

    def run(a: int, b: int):
        leaves = [
            x.detach().clone().requires_grad_()
            for x in (q[:, a:b], latents[0][:, :b], latents[1][:, a:b], latents[2][:, a:b], weight)
        ]
        expand = ChainKeysValues(partial(mla_keys_values, num_heads=nh, nope=nope, v_dim=v_dim), (leaves[-1],), width=1)
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device) if cuda else 0
        t0 = time.perf_counter()
        out = ttt_attention_of_entries(
            leaves[0], (leaves[1],), [(leaves[2],), (leaves[3],)], segments[:, :b], backend, expand, expand
        )
        out.backward(dout[:, a:b])
        if cuda:
            torch.cuda.synchronize(device)
        took = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated(device) - before if cuda else None
        return [out.detach(), *(x.grad for x in leaves)], took, peak

    run(0, seq_len)  # warm-up
    whole, whole_s, whole_peak = run(0, seq_len)
    size = seq_len // parts
    edges = [(i * size, seq_len if i == parts - 1 else (i + 1) * size) for i in range(parts)]
    got = [torch.zeros_like(t, dtype=torch.float32) for t in whole]
    for a, b in edges:
        grads, last_s, last_peak = run(a, b)
        for i, t in enumerate(grads):
            if i == 2:  # step 0's latents: every position up to the shard's end
                got[i][:, :b] += t
            elif i == 5:  # kv_b_proj's weight
                got[i] += t
            else:  # the shard's own rows
                got[i][:, a:b] = t
    names = ["output", "q", "step0_latents", "chain_latents_1", "chain_latents_2", "kv_b_proj"]
    error = {
        n: float((x.float() - y.float()).abs().max() / y.float().abs().max()) for n, x, y in zip(names, got, whole)
    }
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    return {
        "seq_len": seq_len,
        "shards": parts,
        "heads": nh,
        "max_error": error,
        "passed": max(error.values()) <= tolerance,
        "last_shard_s": last_s,
        "whole_s": whole_s,
        "last_shard_peak_bytes": last_peak,
        "whole_peak_bytes": whole_peak,
    }
