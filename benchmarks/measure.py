"""How the training-step benchmark measures: timing, peak memory, device facts, the result dict.

    run_benchmark(BenchConfig(shape="kimi_k26", seq_len=4096, peer="speculators"))

Before timing, the fast attention paths are checked against the reference at the shape's heads
on the benchmark's device and dtype (`benchmarks.attention_check`); a disagreement stops the run.

Peak memory: on CUDA `torch.cuda.max_memory_allocated` over the timed steps (absolute: it
includes parameters, gradients and optimizer state). On CPU, in a fresh process over two steps:
the peak of the bytes the step's tensors hold (`LiveTensorBytes`, counted by storage through a
dispatch mode): every tensor a step makes counts (and the gradients and AdamW moments), the
built model and its inputs do not. The rise of the resident set's high-water mark (`VmHWM`,
reset through `/proc/self/clear_refs`) is recorded beside it as a cross-check: it also counts
what the allocator keeps and so varies with the machine's history and load.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import platform
import statistics
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.attention_check import check_attention_parity
from benchmarks.train_step import BenchConfig, EagleStep
from eagle31.estimate import step_flops

GiB = 1024**3
ROOT = Path(__file__).resolve().parent.parent

# Dense bf16 tensor-core peaks (TFLOP/s) for MFU; other devices report none unless peak_tflops= is given.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "B200": 2250.0}


# ----------------------------------------------------------------------------
# timing and memory


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_interleaved(steps: dict[str, Callable[[], None]], warmup: int, repeats: int, device) -> dict[str, list[float]]:
    """Seconds per step of each side; sides alternate step by step, so load drift hits all alike."""
    for _ in range(warmup):
        for step in steps.values():
            step()
    _sync(device)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    return times


def build_step(side: str, bench: BenchConfig):
    """`EagleStep` or `SpeculatorsStep`: a callable running one full training step."""
    if side == "eagle31":
        return EagleStep(bench)
    from benchmarks.peer import SpeculatorsStep

    return SpeculatorsStep(bench)


class LiveTensorBytes(TorchDispatchMode):
    """Bytes held by the tensors made while it is active: now (`live`) and at most (`peak`).

    Every tensor an operator returns is counted by its storage, once however many views or
    in-place results share it, until the last of them is freed; tensors made before it was
    entered (the built model, the batch) are not counted. Unlike the resident set, it sees
    neither what the allocator keeps for later nor other processes' load: what the tensors hold.
    """

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._storages: dict[int, list[int]] = {}  # storage address -> [tensors alive, bytes]

    def reset_peak(self) -> None:
        self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {
            t.untyped_storage().data_ptr()
            for t in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.device.type != "meta"
        }
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t, inputs)
        return out

    def _track(self, t: torch.Tensor, inputs: set[int]) -> None:
        storage = t.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if size == 0:
            return
        entry = self._storages.get(key)
        if entry is None:
            if key in inputs:  # a view or in-place result of a tensor made before: not new memory
                return
            entry = self._storages[key] = [0, size]
            self.live += size
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        entry = self._storages[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self._storages[key]
            self.live -= entry[1]


def cpu_step_peak_bytes(side: str, bench: BenchConfig) -> int:
    """Peak bytes the tensors of `side`'s steps hold above the built model, in a fresh process."""
    return cpu_step_memory(side, bench)["tensor_peak_bytes"]


def cpu_step_memory(side: str, bench: BenchConfig, child: str = "benchmarks.measure:_peak_child") -> dict[str, int]:
    """Run `child` ("module:function") in a fresh process; it prints one JSON line, returned. By default
    two steps of `side`: their peak tensor bytes (`LiveTensorBytes`) and the rise of the resident set."""
    spec = json.dumps({"side": side, "bench": dataclasses.asdict(bench)})
    module, function = child.split(":")
    code = f"import sys; from {module} import {function}; {function}(sys.argv[1])"
    out = subprocess.run([sys.executable, "-c", code, spec], capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"memory measurement of {side} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _peak_child(spec: str) -> None:
    """Body of `cpu_step_memory`'s process: build, two steps counted by tensors and by the resident set."""
    args = json.loads(spec)
    bench = BenchConfig(**args["bench"])
    if bench.threads:
        torch.set_num_threads(bench.threads)
    step = build_step(args["side"], bench)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # Linux: reset the peak RSS to the current RSS
    before = _proc_status_kib("VmRSS")
    with LiveTensorBytes() as tensors:
        step()  # the first step also creates the gradients and AdamW's moments
        step()
    rss = (_proc_status_kib("VmHWM") - before) * 1024
    print(json.dumps({"tensor_peak_bytes": tensors.peak, "rss_peak_bytes": rss}))


def step_tensor_peak_bytes(side: str, bench: BenchConfig) -> int:
    """Peak bytes the tensors of two steps of `side` hold above the built model, measured in this
    process: `LiveTensorBytes` counts only the tensors made while it is active, so, unlike the
    resident set, it needs no fresh process (the same bytes as `cpu_step_peak_bytes`)."""
    threads = torch.get_num_threads()
    if bench.threads:
        torch.set_num_threads(bench.threads)
    try:
        step = build_step(side, bench)
        gc.collect()
        with LiveTensorBytes() as tensors:
            step()
            step()
        return tensors.peak
    finally:
        torch.set_num_threads(threads)


def _proc_status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}: CPU peak memory needs Linux")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"CPU {model}, {torch.get_num_threads()} threads"


def device_peak_tflops(bench: BenchConfig, device: torch.device) -> float | None:
    if bench.peak_tflops > 0:
        return bench.peak_tflops
    if device.type == "cuda" and bench.compute_dtype() == torch.bfloat16:
        name = torch.cuda.get_device_name(device)
        return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    return None


def run_benchmark(bench: BenchConfig, log: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Measure our step (and the peer's, when asked and importable); return a JSON-able result."""
    threads = torch.get_num_threads()
    if bench.threads:
        torch.set_num_threads(bench.threads)
    try:
        return _run_benchmark(bench, log)
    finally:
        torch.set_num_threads(threads)


def _run_benchmark(bench: BenchConfig, log: Callable[[str], None]) -> dict[str, Any]:
    device, dtype = bench.torch_device(), bench.compute_dtype()
    cfg = bench.drafter_config()
    flops = step_flops(cfg, bench.seq_len, bench.ttt_length)
    peak_tflops = device_peak_tflops(bench, device)
    result: dict[str, Any] = {
        "name": bench.name(),
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "device": device_name(device),
        "config": dataclasses.asdict(bench),
        "precision": str(dtype).removeprefix("torch."),
        "flops_per_step": flops,
        "flops_formula": (
            "eagle31.estimate.step_flops: matmul FLOPs, fwd + bwd = 3x fwd (fc 2x), the keys each query sees"
        ),
        "peak_tflops": peak_tflops,
        "runs": {},
    }
    sides = ["eagle31"]
    if bench.peer == "speculators":
        from benchmarks.peer import speculators_unavailable

        reason = speculators_unavailable()
        if reason:
            result["runs"]["speculators"] = {"error": f"skipped: {reason}"}
        else:
            sides.append("speculators")
    log(f"parity check of the fast attention on {device} ({dtype})")
    backends = None if bench.attention == "auto" else (bench.attention,)  # the one asked for, or every fused one
    result["attention_parity"] = check_attention_parity(cfg, device, dtype, backends=backends)
    if device.type == "cuda":
        for side in sides:  # one at a time: the peak of each is its own
            log(f"{side}: build, {bench.warmup} warm-up + {bench.repeats} timed steps")
            result["runs"][side] = _cuda_side(side, bench, device)
    else:
        steps = {}
        for side in sides:
            log(f"{side}: build")
            steps[side] = build_step(side, bench)
        log(f"{'/'.join(sides)}: {bench.warmup} warm-up + {bench.repeats} timed steps, interleaved")
        times = time_interleaved(steps, bench.warmup, bench.repeats, device)
        del steps
        for side in sides:
            run = {"step_s_all": times[side]}
            if bench.memory:
                log(f"{side}: peak memory in a fresh process")
                run["peak_bytes"] = cpu_step_peak_bytes(side, bench)
            result["runs"][side] = run
        if len(sides) == 2:  # per-round ratios: robust to load that changes between rounds
            rounds = [p / o for o, p in zip(times["eagle31"], times["speculators"])]
            result["speedup_per_round_median"] = statistics.median(rounds)
    for run in result["runs"].values():
        if "step_s_all" in run:
            step = statistics.median(run["step_s_all"])
            run["step_s"] = step
            run["tokens_per_s"] = bench.seq_len / step
            run["tflops_per_s"] = flops / step / 1e12 if flops else None
            run["mfu"] = run["tflops_per_s"] / peak_tflops if flops and peak_tflops else None
        if "peak_bytes" in run:
            run["peak_gib"] = run["peak_bytes"] / GiB
    ours, peer = result["runs"]["eagle31"], result["runs"].get("speculators", {})
    if "step_s" in ours and "step_s" in peer:  # > 1: we are faster
        result["speedup"] = peer["step_s"] / ours["step_s"]
        result["speedup_best"] = min(peer["step_s_all"]) / min(ours["step_s_all"])  # noise only adds time
    return result


def _cuda_side(side: str, bench: BenchConfig, device: torch.device) -> dict[str, Any]:
    step = None
    try:
        step = build_step(side, bench)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)  # build-time temporaries do not count
        times = time_interleaved({side: step}, bench.warmup, bench.repeats, device)[side]
        return {"step_s_all": times, "peak_bytes": torch.cuda.max_memory_allocated(device)}
    except Exception as e:  # noqa: BLE001 — running out of memory is a result (the peer does at long T)
        first_line = (str(e).strip().splitlines() or [""])[0][:300]
        if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower():
            return {"error": f"out of memory: {first_line}"}
        if side == "eagle31":
            raise
        return {"error": f"{type(e).__name__}: {first_line}"}  # the peer failing otherwise is its result too
    finally:
        del step
        gc.collect()
        torch.cuda.empty_cache()
