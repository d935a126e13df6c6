"""Disaggregated features on CPU: trainer wait at 1, 2 and 4 inference workers; engine == online; a killed worker.

    python -m benchmarks.engine_features                              # the demo target, 30 steps a run
    python -m benchmarks.engine_features workers=1,2 steps=20 pace_ms_per_token=0 out=/tmp/ef

Every run is the pipeline `train/main.py` runs (`eagle31.pipeline.run`) of recipe=demo, its data prepared once,
no evaluation, on a Ray cluster of `cpus` CPUs this process starts, the trainer and each worker on one torch
thread. The demo's drafter at its K = 5 trains slower than one worker computes its features (the `k5` run),
so to see what workers buy when inference is what the trainer waits for (as for Kimi K2.6, where 16 inference
GPUs feed 8 trainers) the scaling runs train at K = `ttt_length` (1). Measured from each run's metrics.jsonl,
over the logged windows after the first (the engine's start): the trainer's wait per step (`train/wait_s`),
what the workers can compute (`engine/inference_samples_per_s`), what the trainer could consume
(`train/capacity_samples_per_s`) and consumed (`train/samples_per_s`); ratios to the 1-worker run. The
workers share the machine's cores with the trainer and with each other: ratios, not absolute claims.

On a machine of 2 cores, one worker and the trainer take both: more workers split the same cores. The
paced runs show what the pool does with workers that have hardware of their own, as inference engines on
their own GPUs do: each computation of the HF worker lasts at least `pace_ms_per_token` per token
(`PacedWorker`; its own compute a small part of that), for `paced_steps` steps at 1, 2 and 4 workers.

Equality: the same run with features.mode=online (the target in the trainer's process): loss curve, final
weights and the checkpoint's record of the consumed samples compared with every engine run.

Killed worker: the 2-worker run again while a thread kills worker 0 (`ray.kill`, as the OOM killer would end
it) once a third of the samples are delivered, at a moment it holds a request: its restarts and re-asked
samples, and the consumed record and weights against the uninterrupted 2-worker run.

Writes `<out>/engine_features.json` and `.md` (default benchmarks/results/).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from benchmarks.report import write_result_and_table
from eagle31.checkpoint import read_trainer_state
from eagle31.engine.capacity import measured_sizing
from eagle31.engine.cluster import NAMESPACE, init_ray
from eagle31.engine.worker import HFInferenceWorker
from eagle31.metrics_log import read_metrics
from eagle31_cli import parse_key_values, run_cli

ROOT = Path(__file__).resolve().parents[1]
WINDOW = 5  # train.log_every
PACE = "EAGLE31_BENCHMARK_PACE_S_PER_TOKEN"  # read by PacedWorker, in the workers Ray starts from this process


@dataclasses.dataclass
class Settings:
    workers: str = "1,2,4"  # the scaling runs' worker counts
    steps: int = 30
    ttt_length: int = 1  # K of the scaling runs (the demo recipe's own is 5: the `k5` run)
    cpus: int = 4  # the Ray cluster's CPUs (one per worker)
    pace_ms_per_token: float = 2.0  # the paced workers' least time per token (0: no paced runs)
    paced_steps: int = 20
    out: str = str(ROOT / "benchmarks" / "results")


class PacedWorker(HFInferenceWorker):
    """The HF worker whose every computation lasts at least $EAGLE31_BENCHMARK_PACE_S_PER_TOKEN per token: a stand-in
    for an engine on hardware of its own, whose time is not this machine's (its features are the HF worker's)."""

    def __init__(self, spec):
        super().__init__(spec)
        self.pace = float(os.environ.get(PACE, "0"))

    def features(self, token_rows):
        start = time.perf_counter()
        out = super().features(token_rows)
        time.sleep(max(0.0, self.pace * sum(len(row) for row in token_rows) - (time.perf_counter() - start)))
        return out


# ---------------------------------------------------------------------------- one run


def train(
    out: Path, data: Path, steps: int, mode: str, workers: int = 0, ttt_length: int = 1, kind: type = HFInferenceWorker
) -> Path:
    """A run of recipe=demo into `out` (with workers of `kind` for features.mode=engine); returns it."""
    from unittest import mock

    from eagle31.engine.worker import WORKERS, EngineWorker
    from eagle31.pipeline import run
    from eagle31.recipe import load_recipe

    overrides = [
        "recipe=demo",
        f"output_dir={out}",
        f"data.prepared_dir={data}",
        f"features.mode={mode}",
        f"train.ttt_length={ttt_length}",
        f"train.max_steps={steps}",
        f"train.log_every={WINDOW}",
        "train.eval_every=0",
        "train.save_every=0",
        "eval.enabled=false",
        "export.formats=[eagle3]",
        "logging.progress=false",
        "logging.wandb.mode=disabled",
    ]
    if mode == "engine":
        overrides += [f"features.engine.workers={workers}", "features.engine.worker_cpus=1"]
    with mock.patch.dict(WORKERS, {EngineWorker.hf: kind}):
        run(load_recipe(ROOT / "recipes", overrides))
    return out


def consumed(run_dir: Path) -> list[dict]:
    """Every rank's record of the samples it trained on, from the run's last checkpoint."""
    return [
        rank["consumed"]
        for rank in read_trainer_state(sorted((run_dir / "checkpoints").glob("step_*"))[-1])["data_ranks"]
    ]


def measure(run_dir: Path, workers: int) -> dict:
    """Medians over the windows after the first, and the workers these rates say keep one trainer busy."""
    windows = [x for x in read_metrics(run_dir / "metrics.jsonl") if "train/wait_s" in x][1:]
    median = lambda key: statistics.median(x[key] for x in windows)  # noqa: E731
    last = (
        read_metrics(run_dir / "metrics.jsonl")[-1]
        if "engine/worker_restarts" in read_metrics(run_dir / "metrics.jsonl")[-1]
        else [x for x in read_metrics(run_dir / "metrics.jsonl") if "engine/worker_restarts" in x][-1]
    )
    sizing = measured_sizing(run_dir / "metrics.jsonl", trainers=1)
    return {
        "workers": workers,
        "wait_s_per_step": round(median("train/wait_s"), 4),
        "inference_samples_per_s": round(median("engine/inference_samples_per_s"), 2),
        "training_capacity_samples_per_s": round(median("train/capacity_samples_per_s"), 2),
        "consumed_samples_per_s": round(median("train/samples_per_s"), 2),
        "worker_restarts": last["engine/worker_restarts"],
        "requeued": last["engine/requeued"],
        "workers_for_one_trainer": sizing.workers if sizing else None,
    }


def same_run(a: Path, b: Path) -> dict:
    """Loss curves, final weights and consumed records of two runs, compared."""
    la, lb = ([x["train/loss"] for x in read_metrics(r / "metrics.jsonl") if "train/loss" in x] for r in (a, b))
    wa, wb = (load_file(str(r / "drafter" / "model.safetensors")) for r in (a, b))
    diff = max(float((wa[k].double() - wb[k].double()).abs().max()) for k in wa if wa[k].is_floating_point())
    equal = wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    return {
        "losses_equal": la == lb,
        "weights_max_abs_diff": diff,
        "weights_equal": equal,
        "consumed_equal": consumed(a) == consumed(b),
    }


# ---------------------------------------------------------------------------- the kill


def kill_a_worker_when(ray, delivered: int, done: dict) -> threading.Thread:
    """A thread that finds the run's pool, waits until it has delivered `delivered` samples, then kills worker 0
    while it holds a request; `done` says when and what it held."""

    def watch() -> None:
        pool = None
        while pool is None:
            names = [
                a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("features-")
            ]
            pool = ray.get_actor(names[0], namespace=NAMESPACE) if names else None
            time.sleep(0.2)
        while ray.get(pool.stats.remote())["delivered_samples"] < delivered:
            time.sleep(0.05)
        while "held" not in done:
            handle, held = ray.get(pool.workers.remote())[0]
            if held:
                ray.kill(handle, no_restart=True)
                done.update(held=held, at_samples=ray.get(pool.stats.remote())["delivered_samples"])
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


# ---------------------------------------------------------------------------- report


def scaling_table(rows: list[dict]) -> list[str]:
    base = rows[0]["wait_s_per_step"]
    out = [
        "| workers | trainer wait s/step | wait vs 1 worker | inference capacity samples/s "
        "| training capacity samples/s | consumed samples/s | workers for 1 trainer (measured) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['wait_s_per_step'] / base:.2f}x" if base > 0 else "-"
        out.append(
            f"| {r['workers']} | {r['wait_s_per_step']:.3f} | {ratio} | {r['inference_samples_per_s']:.1f} | "
            f"{r['training_capacity_samples_per_s']:.1f} | {r['consumed_samples_per_s']:.1f} | "
            f"{r['workers_for_one_trainer']} |"
        )
    return out


def table(result: dict) -> str:
    s = result["settings"]
    out = [
        f"Features from inference workers on Ray (recipe=demo, CPU, {s['cpu_count']} cores, Ray CPUs {s['ray_cpus']}, "
        f"{s['steps']} steps, K = {s['ttt_length']}; medians over {WINDOW}-step windows after the first)",
        "",
        *scaling_table(result["scaling"]),
    ]
    if result.get("paced"):
        out += [
            "",
            f"Paced workers (each computation at least {s['pace_ms_per_token']} ms per token, as an engine on "
            f"hardware of its own; {s['paced_steps']} steps, K = {s['ttt_length']}):",
            "",
            *scaling_table(result["paced"]),
        ]
    k5 = result["k5"]
    out += [
        "",
        f"At the demo's own K = 5, one worker: trainer wait {k5['wait_s_per_step']:.3f} s/step, inference capacity "
        f"{k5['inference_samples_per_s']:.1f} samples/s against a training capacity of "
        f"{k5['training_capacity_samples_per_s']:.1f}: the measured rates ask for {k5['workers_for_one_trainer']} "
        "worker(s) to keep the trainer busy.",
        "",
        "Engine against online features (the target in the trainer's process), same settings:",
        "",
        "| run | losses equal | final weights max abs diff | consumed samples equal |",
        "|---|---|---|---|",
    ]
    for name, cmp in result["equality"].items():
        out.append(f"| {name} | {cmp['losses_equal']} | {cmp['weights_max_abs_diff']:g} | {cmp['consumed_equal']} |")
    k = result["killed"]
    out += [
        "",
        f"Killed worker: worker 0 of 2 killed (ray.kill) after {k['kill']['at_samples']} samples were delivered, "
        f"holding {k['kill']['held']} request(s): {k['run']['worker_restarts']} restart, {k['run']['requeued']} "
        "samples asked again; against the uninterrupted 2-worker run: losses equal "
        f"{k['vs_uninterrupted']['losses_equal']}, final weights equal {k['vs_uninterrupted']['weights_equal']}, "
        f"consumed samples equal {k['vs_uninterrupted']['consumed_equal']} (nothing lost, nothing repeated).",
    ]
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> None:
    import ray

    args = parse_key_values(argv, Settings)
    workers = [int(w) for w in args.workers.split(",")]
    steps, K, cpus, out = args.steps, args.ttt_length, args.cpus, Path(args.out)
    torch.set_num_threads(1)  # the trainer on one thread, as each worker (features.engine.worker_cpus=1)
    os.environ[PACE] = str(args.pace_ms_per_token / 1000)  # before Ray starts: its workers inherit this environment
    init_ray(
        ray,
        num_cpus=cpus,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.ERROR,
        namespace=NAMESPACE,
    )
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = work / "data"
        online = train(work / "online", data, steps, "online", ttt_length=K)
        runs = {n: train(work / f"engine{n}", data, steps, "engine", n, K) for n in workers}
        k5 = train(work / "k5", data, steps, "engine", 1, 5)
        two = runs.get(2) or train(work / "engine2", data, steps, "engine", 2, K)
        done: dict = {}
        third = consumed(two)[0]["samples"] // 3
        killer = kill_a_worker_when(ray, third, done)
        killed = train(work / "killed", data, steps, "engine", 2, K)
        killer.join(timeout=5)
        paced = []
        if args.pace_ms_per_token > 0:
            paced = [
                measure(train(work / f"paced{n}", data, args.paced_steps, "engine", n, K, PacedWorker), n)
                for n in workers
            ]
        result = {
            "settings": {
                "recipe": "demo",
                "steps": steps,
                "ttt_length": K,
                "ray_cpus": cpus,
                "workers": workers,
                "pace_ms_per_token": args.pace_ms_per_token,
                "paced_steps": args.paced_steps,
                "cpu_count": os.cpu_count(),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "ray": ray.__version__,
                "command": "python -m benchmarks.engine_features " + " ".join(argv),
            },
            "scaling": [measure(runs[n], n) for n in workers],
            "paced": paced,
            "k5": measure(k5, 1),
            "equality": {f"{n} worker(s)": same_run(runs[n], online) for n in workers},
            "killed": {"kill": done, "run": measure(killed, 2), "vs_uninterrupted": same_run(killed, two)},
            "wall_time_s": round(time.time() - started, 1),
        }
    ray.shutdown()
    write_result_and_table(result, out / "engine_features.json", table(result))


if __name__ == "__main__":
    sys.exit(run_cli(lambda: main(sys.argv[1:])))
