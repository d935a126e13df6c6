"""Training-step benchmark (issue 8): our step against vLLM `speculators`' on the same shapes.

* `SHAPES`: drafter shapes of the reference points (DESIGN §7) and a CPU-sized one;
* `BenchConfig`: what to measure (`scripts/benchmark_train_step.py` parses it from `key=value`);
* `EagleStep` / `SpeculatorsStep` (`eagle31.bench_peer`): one full training step each —
  forward, backward, gradient clipping, AdamW — on the same synthetic packed sequence;
* `step_flops`: the model FLOPs of one step (formula in its docstring), for tokens/s and MFU;
* `run_benchmark`: parity check of the fast attention, warm-up, timed steps, peak memory.

Peak memory: on CUDA `torch.cuda.max_memory_allocated` over the timed steps (absolute: it
includes parameters, gradients and optimizer state, as DESIGN §7's figures do). On CPU, in a fresh
process: the resident-set high-water mark (`VmHWM`, reset through `/proc/self/clear_refs`
once the model is built) minus the resident set at that moment, over two steps: every
temporary a step allocates counts (and the gradients and AdamW moments), the built model
and its inputs do not.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from eagle31.attention import reference_attention, segment_ids, ttt_attention
from eagle31.config import ConfigError, DrafterConfig
from eagle31.data.batch import FeatureBatch
from eagle31.loss import TargetHead
from eagle31.model import Eagle31Drafter
from eagle31.vocab import vocab_maps

GiB = 1024**3

# Drafter shapes (the target's layer shape; aux ids in vLLM's convention, DESIGN §2).
SHAPES: dict[str, dict[str, Any]] = {
    "kimi_k26": dict(
        hidden_size=7168, num_attention_heads=64, num_key_value_heads=64, head_dim=128, intermediate_size=12288,
        vocab_size=163840, draft_vocab_size=32000, target_num_layers=61, aux_layer_ids=(2, 30, 58),
    ),
    "llama31_8b": dict(
        hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336,
        vocab_size=128256, draft_vocab_size=32000, target_num_layers=32, aux_layer_ids=(2, 16, 29),
    ),
    "tiny": dict(
        hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=768,
        vocab_size=8192, draft_vocab_size=2048, target_num_layers=8, aux_layer_ids=(2, 4, 5),
    ),
}  # fmt: skip

# Dense bf16 tensor-core peaks (TFLOP/s) for MFU; other devices report none unless peak_tflops= is given.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "B200": 2250.0}

@dataclass
class BenchConfig:
    """One benchmark: a shape, a sequence length, K, and how to run it."""

    shape: str = "tiny"
    seq_len: int = 1024  # T: tokens of the one packed sequence
    ttt_length: int = 7  # K
    peer: str = "none"  # none | speculators
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | bf16 | fp32
    attention: str = "auto"  # ours: auto | flash | blockwise | reference
    activation_checkpointing: bool = False
    compile: bool = False  # torch.compile the drafter's norms and MLP (CUDA only)
    peer_attention: str = "auto"  # speculators': auto (simple_flex_attention on CUDA, sdpa on CPU) | sdpa | eager
    warmup: int = 2
    repeats: int = 5
    memory: bool = True  # measure peak memory
    peak_tflops: float = 0.0  # device peak for MFU; 0 = look it up (CUDA) or leave MFU out
    threads: int = 0  # CPU threads for torch; 0 = torch's default (on a shared machine 1 is steadier)
    seed: int = 0
    overrides: dict[str, Any] = field(default_factory=dict)  # DrafterConfig fields over the shape

    ARG_NAMES = {"T": "seq_len", "ttt": "ttt_length", "ckpt": "activation_checkpointing"}

    @classmethod
    def from_args(cls, argv: Sequence[str]) -> "BenchConfig":
        """`key=value` arguments; `T`, `ttt` and `ckpt` abbreviate seq_len, ttt_length, activation_checkpointing."""
        known = {f.name: f for f in dataclasses.fields(cls) if f.name != "overrides"}
        names = {**{n: n for n in known}, **cls.ARG_NAMES}
        values: dict[str, Any] = {}
        for arg in argv:
            key, sep, value = arg.partition("=")
            if not sep or key not in names:
                raise ConfigError(f"unknown argument {arg!r}; expected key=value with key in {sorted(names)}")
            name = names[key]
            kind = str(known[name].type)
            try:
                if kind == "bool":
                    if value.lower() not in ("true", "false", "1", "0"):
                        raise ValueError(value)
                    values[name] = value.lower() in ("true", "1")
                elif kind == "int":
                    values[name] = int(value)
                elif kind == "float":
                    values[name] = float(value)
                else:
                    values[name] = value
            except ValueError:
                raise ConfigError(f"{key}={value!r}: expected a {kind}") from None
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        if self.shape not in SHAPES:
            raise ConfigError(f"shape={self.shape!r} is unknown; choose one of {sorted(SHAPES)}")
        for name in ("seq_len", "ttt_length", "repeats"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)}")
        if self.warmup < 0 or self.threads < 0:
            raise ConfigError(f"warmup and threads must be >= 0, got {self.warmup} and {self.threads}")
        choices = {
            "peer": ("none", "speculators"),
            "device": ("auto", "cpu", "cuda"),
            "precision": ("auto", "bf16", "fp32"),
            "attention": ("auto", "flash", "blockwise", "reference"),
            "peer_attention": ("auto", "simple_flex_attention", "sdpa", "eager"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}={getattr(self, name)!r}; choose one of {list(allowed)}")
        if self.compile and self.torch_device().type != "cuda":
            raise ConfigError("compile=true is for CUDA runs (on CPU torch.compile does not pay here)")

    # ------------------------------------------------------------------ derived

    def torch_device(self) -> torch.device:
        kind = self.device
        if kind == "auto":
            kind = "cuda" if torch.cuda.is_available() else "cpu"
        if kind == "cpu":
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise ConfigError("device=cuda but no CUDA device is available")
        return torch.device("cuda", torch.cuda.current_device())

    def compute_dtype(self) -> torch.dtype:
        precision = self.precision
        if precision == "auto":
            precision = "bf16" if self.torch_device().type == "cuda" else "fp32"
        return torch.bfloat16 if precision == "bf16" else torch.float32

    def drafter_config(self) -> DrafterConfig:
        values = {**SHAPES[self.shape], **self.overrides}
        values.setdefault("max_position_embeddings", max(4096, self.seq_len + self.ttt_length))
        return DrafterConfig(**values)

    def name(self) -> str:
        ckpt = "-ckpt" if self.activation_checkpointing else ""
        return f"{self.shape}-T{self.seq_len}-K{self.ttt_length}{ckpt}-{self.torch_device().type}"


# ----------------------------------------------------------------------------
# FLOPs


def step_flops(cfg: DrafterConfig, seq_len: int, ttt_length: int) -> int:
    """Model FLOPs of one training step on one sequence of T = `seq_len` tokens (one document).

    Matrix multiplications only, 2 FLOPs per multiply-add, backward = 2x forward for
    trainable layers whose input also needs a gradient (PaLM's convention, no
    recomputation counted — activation checkpointing and the loss's recomputed logits
    are overhead, not model FLOPs):

        fc (input has no gradient: forward + weight gradient)     2 * 2 T (n Ht) H
        per TTT step, 3x forward of
            q, k, v (2H wide input), o, SwiGLU MLP, lm_head       2 T (2H (nh + 2 nkv) d + nh d H + 3 H I + H Vd)
            attention: QK^T and PV over the visible keys          4 nh d (T (T + 1) / 2 + k T)

    The labels (target lm_head rows, the full-vocabulary argmax) are data preparation and
    not counted; `speculators` runs the same model, so the same count serves both.
    """
    T, K = seq_len, ttt_length
    H, I, Vd = cfg.hidden_size, cfg.intermediate_size, cfg.draft_vocab_size
    nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    fc = 2 * 2 * T * cfg.fc_in_features * H
    dense = 2 * T * (2 * H * (nh + 2 * nkv) * d + nh * d * H + 3 * H * I + H * Vd)
    attention = sum(4 * nh * d * (T * (T + 1) // 2 + k * T) for k in range(K))
    return fc + 3 * (K * dense + attention)


# ----------------------------------------------------------------------------
# synthetic inputs


def synthetic_batch(cfg: DrafterConfig, seq_len: int, seed: int = 0) -> FeatureBatch:
    """One packed sequence of one document, loss mask on everywhere; fp32 features, on CPU."""
    g = torch.Generator().manual_seed(seed)
    T = seq_len
    return FeatureBatch(
        input_ids=torch.randint(0, cfg.vocab_size, (1, T), generator=g),
        loss_mask=torch.ones(1, T, dtype=torch.long),
        document_ids=torch.zeros(1, T, dtype=torch.long),
        aux=torch.randn(1, T, cfg.fc_in_features, generator=g),
        final=torch.randn(1, T, cfg.target_hidden_size, generator=g),
    )


def random_vocab(cfg: DrafterConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(draft ids [Vd] ascending, d2t [Vd], t2d [V]): a random draft vocabulary."""
    g = torch.Generator().manual_seed(seed)
    draft_ids = torch.randperm(cfg.vocab_size, generator=g)[: cfg.draft_vocab_size].sort().values
    d2t, t2d = vocab_maps(draft_ids, cfg.vocab_size)
    return draft_ids, d2t, t2d


def random_target_lm_head(cfg: DrafterConfig, device, dtype, seed: int = 0) -> torch.Tensor:
    """[V, Ht] random target lm_head, made on `device` (the Kimi one is 1.2 B values)."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.empty(cfg.vocab_size, cfg.target_hidden_size, device=device, dtype=dtype)
    return w.normal_(0.0, cfg.target_hidden_size**-0.5, generator=g)


# ----------------------------------------------------------------------------
# our step: exactly the trainer's


class EagleStep:
    """One `Trainer.train_step` (prepare → TTT unroll + loss → backward → clip → AdamW) on one batch.

    On CUDA the drafter is sharded with FSDP2 as in training (bf16 compute, fp32 master
    weights); a one-process group is created when none exists.
    """

    name = "eagle31"

    def __init__(self, bench: BenchConfig):
        from eagle31.distributed import World, ensure_single_process_group
        from eagle31.recipe import TrainConfig
        from eagle31.trainer import Trainer

        cfg = bench.drafter_config()
        device, dtype = bench.torch_device(), bench.compute_dtype()
        torch.manual_seed(bench.seed)
        draft_ids, d2t, t2d = random_vocab(cfg, bench.seed)
        with torch.device(device):  # built in place: the Kimi drafter has 2.2 B values
            drafter = Eagle31Drafter(cfg)
        drafter.set_vocab(d2t, t2d)
        if bench.compile:
            drafter.compile_blocks()
        train = TrainConfig(
            ttt_length=bench.ttt_length,
            attention=bench.attention,
            activation_checkpointing=bench.activation_checkpointing,
            mask_out_of_vocab=False,  # random features: supervise every position, as real batches nearly do
            warmup_steps=1,
            max_steps=1_000_000,
        )
        if device.type == "cuda":
            ensure_single_process_group(device)
        head = TargetHead(random_target_lm_head(cfg, device, dtype, bench.seed), draft_ids.to(device))
        world = World(rank=0, world_size=1, local_rank=device.index or 0, device=device)
        self._run_dir = tempfile.TemporaryDirectory(prefix="eagle31-bench-")
        self.trainer = Trainer(train, world, Path(self._run_dir.name), drafter, head, None, None, dtype)
        # already on the device, as the peer's inputs are: a loader overlaps this copy in training
        self.batch = synthetic_batch(cfg, bench.seq_len, bench.seed).to(device, dtype)

    def __call__(self) -> None:
        self.trainer.train_step([self.batch])


# ----------------------------------------------------------------------------
# attention parity (the fused kernels cannot run on CPU CI: check them where they run)


def check_attention_parity(cfg: DrafterConfig, device: torch.device, dtype: torch.dtype, seq_len: int = 300) -> dict:
    """Fast attention backends against `reference_attention`: forward and gradients.

    Packed documents, padding and chain keys of a step k = 3 query, at the shape's heads
    and head_dim. Inputs are rounded to `dtype` once; the reference runs in fp32 on the
    same values. Raises RuntimeError when a backend disagrees; returns the max errors.
    """
    g = torch.Generator(device="cpu").manual_seed(0)
    nh, nkv, d, T, j = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, seq_len, 3

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    inputs = [rand(1, T, nh, d)] + [rand(1, T, nkv, d) for _ in range(2 + 2 * j)]  # q, k0, v0, j chain keys, j values
    doc = torch.zeros(1, T, dtype=torch.long)
    doc[0, T // 3 :] = 1
    doc[0, T - T // 5 :] = -1  # padding at the end
    segments = segment_ids(doc.to(device), None, (1, T), device=device)
    dout = rand(1, T, nh, d)

    def run(backend, tensors):
        leaves = [t.detach().requires_grad_() for t in tensors]
        q, k0, v0, chain = leaves[0], leaves[1], leaves[2], leaves[3:]
        if backend == "reference":
            out = reference_attention(q, k0, v0, chain[:j], chain[j:], segments)
        else:
            out = ttt_attention(q, k0, v0, chain[:j], chain[j:], segments, backend)
        grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
        return [out.detach().float()] + [x.float() for x in grads]

    expected = run("reference", [t.float() for t in inputs])
    tol = 1e-4 if dtype == torch.float32 else 5e-2  # max error relative to the largest value; bugs give O(1)
    report = {}
    fused = device.type == "cpu" or dtype in (torch.bfloat16, torch.float16)  # CUDA flash: half precision only
    for backend in ("flash", "blockwise") if fused else ("blockwise",):
        got = run(backend, inputs)
        names = ["out", "dq", "dk0", "dv0"] + [f"dchain_k{i}" for i in range(j)] + [f"dchain_v{i}" for i in range(j)]
        errors = {n: float((a - b).abs().max() / b.abs().max().clamp(min=1e-6)) for n, a, b in zip(names, got, expected)}
        report[backend] = errors
        bad = {n: e for n, e in errors.items() if not math.isfinite(e) or e > tol}
        if bad:
            raise RuntimeError(f"attention backend {backend!r} disagrees with the reference on {device} ({dtype}): {bad}")
    return report


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
    from eagle31.bench_peer import SpeculatorsStep

    return SpeculatorsStep(bench)


def cpu_step_peak_bytes(side: str, bench: BenchConfig) -> int:
    """Peak resident memory of `side`'s steps above the built model, in a fresh process (bytes)."""
    spec = json.dumps({"side": side, "bench": dataclasses.asdict(bench)})
    code = "import sys; from eagle31.bench import _peak_child; _peak_child(sys.argv[1])"
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code, spec], capture_output=True, text=True, cwd=root)
    if out.returncode != 0:
        raise RuntimeError(f"memory measurement of {side} failed:\n{out.stderr[-3000:]}")
    return int(json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"])


def _peak_child(spec: str) -> None:
    """Body of `cpu_step_peak_bytes`' process: build, reset the high-water mark, two steps, report the rise."""
    args = json.loads(spec)
    bench = BenchConfig(**args["bench"])
    if bench.threads:
        torch.set_num_threads(bench.threads)
    step = build_step(args["side"], bench)
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # Linux: reset the peak RSS to the current RSS
    before = _proc_status_kib("VmRSS")
    step()  # the first step also creates the gradients and AdamW's moments
    step()
    print(json.dumps({"peak_bytes": (_proc_status_kib("VmHWM") - before) * 1024}))


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
        "flops_formula": "eagle31.bench.step_flops: matmul FLOPs, fwd + bwd = 3x fwd (fc 2x), causal attention",
        "peak_tflops": peak_tflops,
        "runs": {},
    }
    sides = ["eagle31"]
    if bench.peer == "speculators":
        from eagle31.bench_peer import speculators_unavailable

        reason = speculators_unavailable()
        if reason:
            result["runs"]["speculators"] = {"error": f"skipped: {reason}"}
        else:
            sides.append("speculators")
    log(f"parity check of the fast attention on {device} ({dtype})")
    result["attention_parity"] = check_attention_parity(cfg, device, dtype)
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
            run["tflops_per_s"] = flops / step / 1e12
            run["mfu"] = run["tflops_per_s"] / peak_tflops if peak_tflops else None
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
    except torch.OutOfMemoryError as e:
        return {"error": f"out of memory: {str(e).splitlines()[0]}"}
    finally:
        del step
        gc.collect()
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------
# reporting

_TABLE_START = "<!-- benchmark-table:start -->"
_TABLE_END = "<!-- benchmark-table:end -->"
_HEADER = (
    "| date | device | torch | shape | T | K | ckpt | precision | eagle31 step | tokens/s | MFU | peak | "
    "speculators step | tokens/s | peak | speed-up |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def table_row(result: dict[str, Any]) -> str:
    """One markdown row of `docs/performance.md`'s table."""
    c = result["config"]

    def side(run: dict | None, mfu: bool) -> list[str]:
        if not run:
            return ["—", "—"] + (["—"] if mfu else []) + ["—"]
        if "error" in run:
            return [run["error"].replace("|", "/"), ""] + ([""] if mfu else []) + [""]
        cells = [f"{run['step_s']:.3f} s", f"{run['tokens_per_s']:,.0f}"]
        if mfu:
            cells.append(f"{run['mfu']:.0%}" if run.get("mfu") else "—")
        cells.append(f"{run['peak_gib']:.2f} GiB" if "peak_gib" in run else "—")
        return cells

    speedup = f"{result['speedup']:.2f}x" if "speedup" in result else "—"
    cells = [
        result["date"], result["device"], result["torch"], c["shape"], str(c["seq_len"]), str(c["ttt_length"]),
        "yes" if c["activation_checkpointing"] else "no", result["precision"],
        *side(result["runs"].get("eagle31"), True), *side(result["runs"].get("speculators"), False), speedup,
    ]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def update_table(doc: str | Path, result: dict[str, Any]) -> None:
    """Add `result`'s row to the table between the markers of `doc` (created when missing).

    A row for the same device, torch, shape, T, K, checkpointing and precision is replaced.
    """
    doc = Path(doc)
    text = doc.read_text() if doc.is_file() else "# Performance\n"
    if _TABLE_START not in text:
        text = text.rstrip("\n") + f"\n\n{_TABLE_START}\n{_HEADER}\n{_TABLE_END}\n"
    head, rest = text.split(_TABLE_START, 1)
    body, tail = rest.split(_TABLE_END, 1)
    row = table_row(result)
    key = _row_key(row)
    rows = [r for r in body.strip().splitlines()[2:] if r.startswith("|") and _row_key(r) != key]
    rows.append(row)
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(f"{head}{_TABLE_START}\n{_HEADER}\n" + "\n".join(rows) + f"\n{_TABLE_END}{tail}")


def _row_key(row: str) -> tuple[str, ...]:
    cells = [c.strip() for c in row.strip().strip("|").split("|")]
    return tuple(cells[1:8])  # device .. precision


def write_result(result: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path
