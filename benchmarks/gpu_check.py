"""One command that checks the project on a CUDA machine and measures its speed and memory goals.

    python -m benchmarks.gpu_check <out dir> [--wheels benchmarks/wheels]   # on the GPU machine (< 8 min, H200)
    python -m benchmarks.gpu_check --cpu-smoke <out dir>                    # tiny shapes on CPU (CI)
    python -m benchmarks.gpu_check --to-doc <out dir>/summary.json          # its table into docs/performance.md

Run from the repository root. Parts, each in its own process with its own time budget (a hang
or an out-of-memory crash ends that part only; the whole check stays within `--budget-s`):

    environment   torch, CUDA, GPU, driver, optional packages, private-op signatures
    attention     fused attention vs the reference (forward, all gradients, bf16) at every recipe's
                  drafter shape, packed documents, padding, chain keys
    trainer       train/main.py under `torchrun --nproc-per-node 1` (NCCL): train, checkpoint, resume, export
    memory        the memory model's shapes (`benchmarks.memory_model`): the peak of two steps
                  (`torch.cuda.max_memory_allocated`) beside `eagle31.estimate`'s total for CUDA
    sequence parallel  `benchmarks.sequence_parallel`'s step at N = 1 (NCCL) through the sequence-
                  parallel code path beside the plain one: step time, peak memory, their ratios; the
                  Kimi K2.6 MLA attention of 4 shards (block-wise earlier keys) vs the whole sequence's
    benchmark …   training-step benchmark runs: the Kimi K2.6 drafter at T = 4096, 65536 (activation
                  checkpointing), 16384, the Llama 3.1 8B drafter at 4096 — each against vLLM
                  `speculators`' drafter where it imports (its running out of memory is a result)

A study runs its own GPU parts through `check_main(parts=...)` (the side-by-side of
`experiments/side_by_side/gpu.py`: a second command, since one command of a lent GPU machine may run
10 minutes); a part's kind `module:function` names the function its process calls with (smoke, out).

Writes `<out dir>/summary.json` and `summary.md` (pass/fail per part, step time, tokens/s, MFU
with the FLOP count, peak memory, ratios to the peer), each part's JSON under `parts/` and its
output under `logs/`. With `--wheels DIR` (default `benchmarks/wheels` when present: see
`benchmarks/fetch_gpu_wheels.py`) missing packages are installed first, with no network.
Exit code 0 when every part passed or was skipped, 1 otherwise, 2 on bad arguments.

This module and `benchmarks.gpu_parts` import only the standard library at the top: the
packages may not be there yet.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.gpu_parts import child_env  # standard library only at import

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_WHEELS = ROOT / "benchmarks" / "wheels"
# Import names the check needs beyond torch (the peer's are optional: without them it is skipped).
NEEDED_MODULES = ("transformers", "hydra", "omegaconf", "safetensors", "datasets", "tokenizers", "yaml", "filelock")
PEER_MODULES = ("speculators", "hs_connectors", "openai", "accelerate")


@dataclass
class Part:
    name: str
    # environment | attention | trainer | memory | sequence_parallel | benchmark | unavailable | module:function
    kind: str
    budget_s: int
    args: list[str] = field(default_factory=list)  # benchmark: BenchConfig key=value; unavailable: [reason]


ENVIRONMENT = Part("environment", "environment", 60)
BUDGET_S = 470.0  # the whole check's default wall-clock budget (`--budget-s`)


def plan(smoke: bool, gpu_memory_gib: float | None = None) -> list[Part]:
    """The parts after `environment`, most important first (a spent budget skips the last ones)."""
    parts = [
        Part("attention", "attention", 120 if smoke else 90),
        Part("trainer", "trainer", 240 if smoke else 150),
        Part("memory", "memory", 300 if smoke else 120),
        Part("sequence parallel", "sequence_parallel", 120 if smoke else 45),
    ]
    if smoke:
        tiny = [
            "shape=tiny",
            "T=128",
            "ttt=2",
            "peer=speculators",
            "warmup=0",
            "repeats=1",
            "memory=false",
            "threads=1",
        ]
        parallel = Part("benchmark tiny parallel T=128", "benchmark", 60, [*tiny[:3], "parallel=true", *tiny[4:]])
        return parts + [Part("benchmark tiny T=128", "benchmark", 120, tiny), parallel]
    from benchmarks.shapes import recipe_shapes
    from eagle31.attention import DrafterAttention

    shapes = recipe_shapes().values()
    kimi = next((s.recipe for s in shapes if "Kimi-K2.6" in s.target and s.attention is DrafterAttention.llama), None)
    kimi_mla = next((s.recipe for s in shapes if "Kimi-K2.6" in s.target and s.attention is DrafterAttention.mla), None)
    llama = next((s.recipe for s in shapes if s.target == "meta-llama/Llama-3.1-8B-Instruct"), None)
    runs = [  # (recipe, what it is, T, more arguments, budget in seconds)
        (kimi, "Kimi K2.6 drafter", 4096, "peer=speculators warmup=2 repeats=5", 150),
        (kimi, "Kimi K2.6 drafter", 65536, "warmup=1 repeats=1", 150),
        (kimi, "Kimi K2.6 drafter", 16384, "peer=speculators warmup=1 repeats=2", 120),
        (llama, "Llama 3.1 8B drafter", 4096, "peer=speculators warmup=2 repeats=5", 110),
        (kimi_mla, "Kimi K2.6 MLA drafter", 4096, "warmup=2 repeats=3", 90),
        (llama, "Llama 3.1 8B parallel (P-EAGLE) drafter", 4096, "parallel=true warmup=2 repeats=3", 90),
    ]
    for recipe, what, T, args, budget in runs:
        if recipe is None:
            parts.append(
                Part(f"benchmark {what} T={T}", "unavailable", 0, [f"not available: no recipe trains the {what}"])
            )
            continue
        ckpt = needs_checkpointing(recipe, T, gpu_memory_gib)
        name = f"benchmark {recipe} T={T}" + (" ckpt" if ckpt else "")
        parts.append(
            Part(
                name,
                "benchmark",
                budget,
                [f"shape={recipe}", "ttt=7", f"T={T}", f"ckpt={str(ckpt).lower()}", *args.split()],
            )
        )
    return parts


def needs_checkpointing(recipe: str, seq_len: int, gpu_memory_gib: float | None) -> bool:
    """Activation checkpointing where the step's estimated peak without it passes 80% of the GPU (80 GiB if unknown)."""
    return recipe_memory(recipe).at(seq_len)["total"] > 0.8 * (gpu_memory_gib or 80)


@functools.cache
def recipe_memory(recipe: str):
    """The recipe's drafter's run without checkpointing (K = 7), its step traced once for every T asked."""
    from benchmarks.shapes import recipe_drafter
    from eagle31.estimate import RunMemory

    return RunMemory(recipe_drafter(recipe), 7)


# ---------------------------------------------------------------------------- install


def missing_modules(names) -> list[str]:
    return [n for n in names if importlib.util.find_spec(n) is None]


def install_wheels(wheels: Path | None, log: Path) -> dict:
    """pip install --no-index from `wheels` what does not import yet; packages already present are kept."""
    missing = missing_modules(NEEDED_MODULES + PEER_MODULES)
    if not missing:
        return {"status": "skipped", "detail": "every needed package imports"}
    if wheels is None or not (wheels / "requirements.txt").is_file():
        where = wheels or DEFAULT_WHEELS
        return {
            "status": "skipped",
            "detail": f"missing {missing}; no wheels at {where} (benchmarks/fetch_gpu_wheels.py)",
        }
    pip = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--no-index",
        "--find-links",
        str(wheels),
    ]
    if sys.prefix == sys.base_prefix:  # a system interpreter, not a virtual environment
        if not os.access(sys.prefix, os.W_OK):
            pip.append("--user")
        if (Path(sysconfig.get_paths()["stdlib"]) / "EXTERNALLY-MANAGED").exists():
            pip.append("--break-system-packages")  # PEP 668 marker: the GPU machine is lent, not kept
    status = "pass"
    with log.open("w") as f:
        for extra in (
            ["-r", str(wheels / "requirements.txt")],
            ["--no-deps", "-r", str(wheels / "requirements-no-deps.txt")],
        ):
            proc = subprocess.run([*pip, *extra], stdout=f, stderr=subprocess.STDOUT, text=True)
            status = status if proc.returncode == 0 else "fail"
    importlib.invalidate_caches()
    still = missing_modules(NEEDED_MODULES + PEER_MODULES)
    return {
        "status": status,
        "was_missing": missing,
        "still_missing": still,
        "log": str(log.relative_to(log.parents[1])),
    }


# ---------------------------------------------------------------------------- running the parts


def run_part(part: Part, out: Path, smoke: bool, timeout: float) -> dict:
    """Run `part` in a fresh process (its own session: a timeout kills torchrun's workers too)."""
    if part.kind == "unavailable":
        return {"status": "skipped", "detail": part.args[0]}
    slug = part.name.replace(" ", "_").replace("=", "")
    result_path, log_path = out / "parts" / f"{slug}.json", out / "logs" / f"{slug}.log"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.gpu_check",
        "--part",
        part.kind,
        "--result",
        str(result_path),
        "--part-out",
        str(out),
    ]
    cmd += (["--cpu-smoke-part"] if smoke else []) + ["--bench-args", " ".join(part.args)]
    started = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=child_env(), start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended meanwhile
                pass
            proc.wait()
            code = None
    seconds = round(time.monotonic() - started, 1)
    if code is None:
        return {
            "status": "timeout",
            "seconds": seconds,
            "error": f"stopped after its budget of {timeout:.0f} s",
            "log": _tail(log_path),
        }
    if not result_path.is_file():
        return {
            "status": "fail",
            "seconds": seconds,
            "error": f"exited {code} without a result",
            "log": _tail(log_path),
        }
    result = json.loads(result_path.read_text())
    result["seconds"] = seconds
    return result


def _tail(path: Path, chars: int = 1500) -> str:
    return path.read_text(errors="replace")[-chars:]


def part_main(kind: str, result: Path, out: Path, smoke: bool, args: list[str]) -> int:
    """Body of one part's process: run it, write its JSON (a failure is written too)."""
    import traceback

    from benchmarks import gpu_parts
    from eagle31.io import atomic_write_json

    try:
        if ":" in kind:  # a study's part (`check_main(parts=...)`)
            module, function = kind.split(":")
            report = getattr(importlib.import_module(module), function)(smoke, out)
        elif kind == "trainer":
            report = gpu_parts.trainer(smoke, out)
        elif kind == "benchmark":
            report = gpu_parts.benchmark(args)
        else:
            report = getattr(gpu_parts, kind)(smoke)
    except Exception as e:  # noqa: BLE001 — the part's failure is its result
        traceback.print_exc()
        report = {"status": "fail", "error": f"{type(e).__name__}: {e}"[:3000]}
    atomic_write_json(result, report)
    return 0 if report["status"] in ("pass", "skipped") else 1


def check_main(
    out: Path,
    smoke: bool,
    wheels: Path | None,
    budget_s: float,
    parts: list[Part] | None = None,
    mode: str | None = None,
) -> int:
    """Install what is missing, run `environment`, then `parts` (default: `plan`'s) within `budget_s`; the summary
    under `out`."""
    started = time.monotonic()
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "parts").is_dir())):
        print(f"error: {out} exists and is not an empty directory or an earlier check's output", file=sys.stderr)
        return 2
    for sub in ("parts", "logs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    install = install_wheels(wheels, out / "logs" / "install.log")
    print(f"install: {install['status']} ({install.get('detail') or install.get('still_missing')})", flush=True)
    mode = mode or ("cpu-smoke" if smoke else "gpu")
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "mode": mode,
        "budget_s": budget_s,
        "install": install,
        "parts": {},
    }

    def run(part: Part) -> dict:
        left = budget_s - (time.monotonic() - started)
        if part.kind != "unavailable" and left < 15:
            result = {"status": "not run", "error": "the check's time budget was spent"}
        else:
            result = run_part(part, out, smoke, min(part.budget_s, left))
        summary["parts"][part.name] = result
        print(f"{part.name}: {result['status']}", flush=True)
        return result

    environment = run(ENVIRONMENT)
    try:  # the environment first: the plan sizes activation checkpointing to the GPU it found
        parts = parts if parts is not None else plan(smoke, environment.get("gpu_memory_gib"))
    except Exception as e:  # noqa: BLE001 — without a plan the environment report still says why
        summary["plan_error"] = f"{type(e).__name__}: {e}"
        parts = []
    for part in parts:
        run(part)
    summary["elapsed_s"] = round(time.monotonic() - started, 1)
    from benchmarks.report import summary_markdown
    from eagle31.io import atomic_write_json, atomic_write_text

    atomic_write_json(out / "summary.json", summary)
    atomic_write_text(out / "summary.md", summary_markdown(summary))
    print(f"wrote {out / 'summary.json'} and summary.md in {summary['elapsed_s']:.0f} s")
    failed = [name for name, p in summary["parts"].items() if p["status"] not in ("pass", "skipped")]
    if failed:
        print(f"not passed: {failed}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", nargs="?", type=Path, help="output directory (GPU run)")
    parser.add_argument("--cpu-smoke", type=Path, metavar="OUT", help="the same parts on CPU with tiny shapes")
    parser.add_argument(
        "--wheels", type=Path, help="wheels to install offline (default benchmarks/wheels when present)"
    )
    parser.add_argument(
        "--budget-s", type=float, default=BUDGET_S, help=f"wall-clock budget of all parts (default {BUDGET_S:.0f})"
    )
    parser.add_argument("--to-doc", type=Path, metavar="SUMMARY", help="put a summary.json's table into --doc")
    parser.add_argument(
        "--doc", type=Path, default=ROOT / "docs" / "performance.md", help="default docs/performance.md"
    )
    parser.add_argument("--part", help=argparse.SUPPRESS)  # internal: one part in this process
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--part-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--cpu-smoke-part", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bench-args", default="", help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.part:
        return part_main(ns.part, ns.result, ns.part_out, ns.cpu_smoke_part, ns.bench_args.split())
    if ns.to_doc:
        from benchmarks.report import put_gpu_table

        try:
            summary = json.loads(ns.to_doc.read_text())
        except (OSError, ValueError) as e:
            print(f"error: --to-doc {ns.to_doc}: not a readable summary.json ({e})", file=sys.stderr)
            return 2
        put_gpu_table(ns.doc, summary)
        print(f"updated {ns.doc}")
        return 0
    outs = [o for o in (ns.out, ns.cpu_smoke) if o is not None]
    if len(outs) != 1:
        print(
            "error: give one output directory: `<out dir>` on a GPU machine, or `--cpu-smoke <out dir>`",
            file=sys.stderr,
        )
        return 2
    return check_main(outs[0], ns.cpu_smoke is not None, default_wheels(ns.wheels), ns.budget_s)


def default_wheels(wheels: Path | None) -> Path | None:
    """`--wheels`, else benchmarks/wheels when it exists."""
    return wheels or (DEFAULT_WHEELS if DEFAULT_WHEELS.is_dir() else None)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
