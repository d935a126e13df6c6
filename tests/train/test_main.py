"""`train/main.py`: a run end to end, resume after a kill, torchrun, dry run, and bad input (in-process:
an interpreter per refusal would only re-import torch)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle31.engine.transport import free_ports
from tests.data.chat_helpers import write_jsonl
from tests.helpers import base_args, run_script, sigkill_after_checkpoint
from tests.train.signal_worker import signal_during_step

REPO = Path(__file__).resolve().parents[2]
MAIN = REPO / "train" / "main.py"


def run_main(
    args: list[str], *, torchrun: int = 0, timeout: int = 300, signal_at: str | None = None, **env_vars
) -> subprocess.CompletedProcess:
    """`train/main.py <args>` in a subprocess (under torchrun with `torchrun` ranks); `signal_at`:
    tests/train/signal_worker.py's SIGNAL_AT."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env_vars}
    script = MAIN
    if signal_at:
        env["SIGNAL_AT"], script = signal_at, REPO / "tests" / "train" / "signal_worker.py"
    cmd = [sys.executable, str(script), *args]
    if torchrun:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(torchrun),
            "--master-port",
            str(free_ports(1)[0]),  # a port of its own: another test may run torchrun beside it
            str(script),
            *args,
        ]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=REPO)


def losses(run_dir: Path) -> list[float]:
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x["train/loss"] for x in lines if "train/loss" in x]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "drafter" / "model.safetensors"))


# ---------------------------------------------------------------------------- runs


@pytest.fixture(scope="module")
def reference_run(tiny_target, chats, tmp_path_factory) -> Path:
    """A 6-step run through `train/main.py` in this process (the kill test compares a subprocess run with it)."""
    out = tmp_path_factory.mktemp("runs") / "reference"
    with pytest.MonkeyPatch.context() as monkeypatch:
        assert run_script(MAIN, base_args(tiny_target, chats, out), monkeypatch) == 0
    return out


def test_run_directory_holds_everything(reference_run):
    for name in (
        "config.yaml",
        "metrics.jsonl",
        "report.json",
        "drafter/model.safetensors",
        "export/eagle3/config.json",
        "export/speculators/config.json",
    ):
        assert (reference_run / name).is_file(), name
    report = json.loads((reference_run / "report.json").read_text())
    assert report["steps"] == 6 and report["tokens_seen"] > 0 and report["tau_sim"] >= 1
    assert len(report["acc"]) == 3
    lines = [json.loads(x) for x in (reference_run / "metrics.jsonl").read_text().splitlines()]
    train_lines = [x for x in lines if "train/loss" in x]
    assert [x["step"] for x in train_lines] == [1, 2, 3, 4, 5, 6]
    for key in ("train/loss", "train/acc_0", "train/tau_sim", "train/lr", "train/grad_norm", "train/tokens_per_s"):
        assert key in train_lines[0]
    assert losses(reference_run)[-1] < losses(reference_run)[0]  # it learns
    kept = sorted(p.name for p in (reference_run / "checkpoints").iterdir())
    assert kept == ["step_00000004", "step_00000006"]  # keep_last=2


def test_the_anchor_holds_a_fine_tuned_exported_drafter_near_its_start(reference_run, tiny_target, chats, tmp_path):
    """`drafter.init_from` the reference run's EAGLE-3 export, four steps at a high learning rate: with
    train.anchor_weight=100 every trained weight ends nearer the export's than without the anchor, and
    metrics.jsonl logs the term (0 at the first step, where w = w0)."""
    from eagle31.convert import load_drafter

    start = load_drafter(reference_run / "export" / "eagle3").state_dict()
    distance = {}
    for weight in ("0", "100"):
        out = tmp_path / f"anchor{weight}"
        extra = {"drafter.init_from": str(reference_run / "export" / "eagle3"), "train.anchor_weight": weight}
        args = base_args(tiny_target, chats, out, **extra, **{"train.max_steps": "4", "export.formats": "[]"})
        with pytest.MonkeyPatch.context() as monkeypatch:
            assert run_script(MAIN, [*args, "train.lr=3e-2"], monkeypatch) == 0
        lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        anchor = [x["train/anchor"] for x in lines if "train/anchor" in x]
        assert anchor == [] if weight == "0" else (len(anchor) == 4 and anchor[0] == 0 and min(anchor[1:]) > 0)
        trained = weights(out)
        distance[weight] = {k: float((trained[k] - start[k]).norm()) for k in trained if k.endswith("proj.weight")}
    assert all(distance["100"][k] < 0.5 * distance["0"][k] for k in distance["0"]), distance


def test_fine_tuning_on_other_data_keeps_the_drafters_draft_vocabulary(reference_run, tiny_target, tmp_path):
    """A published drafter's d2t/t2d come with it: prepare keeps them for data whose own most frequent tokens
    differ (else the fine-tuning would be refused, or would relabel the drafter's outputs)."""
    from safetensors.torch import load_file

    from eagle31.convert import load_drafter
    from eagle31.vocab import build_draft_vocab
    from tests.data.chat_helpers import write_jsonl

    export = reference_run / "export" / "eagle3"
    counting = [f"Count from {i} to {i + 9}: " + " ".join(str(j) for j in range(i, i + 10)) for i in range(40)]
    other = write_jsonl(
        tmp_path / "other.jsonl",
        [{"messages": [{"role": "user", "content": "Count."}, {"role": "assistant", "content": t}]} for t in counting],
    )
    out = tmp_path / "fine_tuned"
    extra = {"drafter.init_from": str(export), "train.max_steps": "2", "export.formats": "[]"}
    with pytest.MonkeyPatch.context() as monkeypatch:
        assert run_script(MAIN, base_args(tiny_target, other, out, **extra), monkeypatch) == 0
    vocab, start = load_file(out / "data" / "vocab.safetensors"), load_drafter(export)
    assert torch.equal(vocab["d2t"], start.d2t) and torch.equal(vocab["t2d"], start.t2d)
    counts = load_file(out / "data" / "token_counts.safetensors")["counts"]
    assert not torch.equal(build_draft_vocab(counts, len(start.d2t))[0], start.d2t)  # its own would differ


@pytest.mark.slow
def test_sigkill_then_resume_gives_the_same_final_weights(reference_run, tiny_target, chats, tmp_path):
    out = tmp_path / "killed"
    sigkill_after_checkpoint(
        [sys.executable, str(MAIN), *base_args(tiny_target, chats, out)], out, {**os.environ, "OMP_NUM_THREADS": "1"}
    )

    resumed = run_main(base_args(tiny_target, chats, out, resume="auto"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    a, b = weights(reference_run), weights(out)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert losses(out) == losses(reference_run)


def test_sigterm_stops_with_a_checkpoint_of_that_step_and_resume_is_bit_identical(
    reference_run, tiny_target, chats, tmp_path, capsys
):
    out = tmp_path / "preempted"
    with pytest.MonkeyPatch.context() as monkeypatch:
        signal_during_step(monkeypatch, 3)  # a real SIGTERM to this process, during step 3
        code = run_script(MAIN, base_args(tiny_target, chats, out), monkeypatch)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 143, line
    assert line == (
        f"error: stopped by SIGTERM at step 3: checkpoint {out / 'checkpoints' / 'step_00000003'} is complete; "
        "rerun with resume=auto to continue"
    )
    assert (out / "checkpoints" / "step_00000003" / "COMPLETE").is_file() and not (out / "report.json").exists()
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]  # flushed
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

    with pytest.MonkeyPatch.context() as monkeypatch:
        assert run_script(MAIN, base_args(tiny_target, chats, out, resume="auto"), monkeypatch) == 0
    assert "resumed from" in capsys.readouterr().out
    a, b = weights(reference_run), weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert losses(out) == losses(reference_run)


def evaluations(run_dir: Path) -> list[dict]:
    """The evaluation lines of `run_dir`'s metrics.jsonl, in order."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if any(k.startswith("eval/") for k in x)]


@pytest.mark.slow
def test_the_evaluation_of_a_preempted_step_is_logged_once_by_the_resumed_run(tiny_target, chats, tmp_path, capsys):
    """SIGTERM during step 4, an evaluation step: its checkpoint is written before its evaluation, which the
    resumed run does first. That run SIGKILLed during step 5 has logged it; resumed again from step 4, the
    run logs it once more in its place, not twice: every evaluation point once, as in an uninterrupted run."""
    extra = {"train.eval_every": "2"}
    reference = tmp_path / "reference"
    with pytest.MonkeyPatch.context() as monkeypatch:
        assert run_script(MAIN, base_args(tiny_target, chats, reference, **extra), monkeypatch) == 0
    assert [x["step"] for x in evaluations(reference)] == [2, 4, 6]

    out = tmp_path / "preempted"
    with pytest.MonkeyPatch.context() as monkeypatch:
        signal_during_step(monkeypatch, 4)
        assert run_script(MAIN, base_args(tiny_target, chats, out, **extra), monkeypatch) == 143
    assert [x["step"] for x in evaluations(out)] == [2]
    killed = run_main(base_args(tiny_target, chats, out, resume="auto", **extra), signal_at="0:5:SIGKILL")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert [x["step"] for x in evaluations(out)] == [2, 4]  # the resumed run's first act
    with pytest.MonkeyPatch.context() as monkeypatch:
        assert run_script(MAIN, base_args(tiny_target, chats, out, resume="auto", **extra), monkeypatch) == 0
    assert evaluations(out) == evaluations(reference)


@pytest.mark.parametrize("during", ["save_checkpoint", "evaluate"])
def test_a_signal_during_the_final_checkpoint_or_evaluation_stops_before_the_export(
    tiny_target, chats, tmp_path, capsys, during
):
    """SIGTERM while the last step's checkpoint is written, or during the final evaluation: the run stops there
    (143) instead of exporting and measuring acceptance until the scheduler's SIGKILL; resumed, it evaluates
    once and exports."""
    out = tmp_path / "run"
    with pytest.MonkeyPatch.context() as monkeypatch:
        signal_during_step(monkeypatch, 6, during=during)
        code = run_script(MAIN, base_args(tiny_target, chats, out), monkeypatch)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 143, line
    assert line == (
        f"error: stopped by SIGTERM after the last step (6): checkpoint {out / 'checkpoints' / 'step_00000006'} "
        "is complete; rerun with resume=auto to evaluate and export"
    )
    assert not (out / "export").exists() and not (out / "report.json").exists()
    with pytest.MonkeyPatch.context() as monkeypatch:
        assert run_script(MAIN, base_args(tiny_target, chats, out, resume="auto"), monkeypatch) == 0
    assert (out / "report.json").is_file() and (out / "export" / "eagle3" / "config.json").is_file()
    assert [x["step"] for x in evaluations(out)] == [6]


@pytest.mark.slow
def test_a_second_sigterm_exits_at_once_leaving_the_last_complete_checkpoint(tiny_target, chats, tmp_path):
    out = tmp_path / "run"
    proc = run_main(base_args(tiny_target, chats, out), signal_at="0:3:SIGTERM:2")
    assert proc.returncode == 137, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: a second SIGTERM while stopping on SIGTERM; exited at once: the last complete checkpoint in "
        f"{out / 'checkpoints'} is kept, rerun with resume=auto"
    )
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002"]


@pytest.mark.slow
def test_torchrun_a_signal_to_one_rank_stops_all_and_a_dead_rank_stops_the_others_and_both_resume(
    tiny_target, chats, tmp_path, monkeypatch
):
    """Rank 1 alone gets SIGTERM at step 2: both ranks stop there with a checkpoint (143). Resumed, rank 1 is
    SIGKILLed at step 5: rank 0 names it and exits within train.rank_timeout_s. Resumed on 2 ranks the run ends
    bit-identical to an uninterrupted 2-rank run; on 1 rank (grad_accum=2, the same global batch) equal, within
    float error, to an uninterrupted 1-rank run (an epoch's last batches fall to the ranks differently, so 1 and 2
    ranks differ from the epoch's end on)."""
    import shutil

    extra = {"train.rank_timeout_s": "30", "export.formats": "[eagle3]"}
    reference = tmp_path / "reference"
    done = run_main(base_args(tiny_target, chats, reference, **extra), torchrun=2)
    assert done.returncode == 0, done.stderr[-3000:]

    out = tmp_path / "run"
    stopped = run_main(base_args(tiny_target, chats, out, **extra), torchrun=2, signal_at="1:2:SIGTERM")
    assert stopped.returncode == 1  # torchrun's own code: the workers' 143 is in its failure summary (README)
    for by in ("SIGTERM", "a signal that another rank received"):  # rank 1's line, rank 0's (the two ranks share
        # stderr, so one rank's line may start before the other's newline: look for each line's text)
        said = (
            f"error: stopped by {by} at step 2: checkpoint {out / 'checkpoints' / 'step_00000002'} is complete; "
            "rerun with resume=auto to continue"
        )
        assert said in stopped.stderr, stopped.stderr[-3000:]
    assert "exitcode  : 143" in stopped.stderr

    killed_at = tmp_path / "killed_at"
    killed = run_main(
        base_args(tiny_target, chats, out, resume="auto", **extra),
        torchrun=2,
        signal_at="1:5:SIGKILL",
        SIGNAL_AT_LOG=str(killed_at),
    )
    ended = time.time()
    assert killed.returncode != 0
    lines = [x for x in killed.stderr.splitlines() if x.startswith("error: rank 1 (pid ")]
    assert len(lines) == 1 and "has died; stopping this rank too" in lines[0] and "resume=auto" in lines[0], (
        killed.stderr[-3000:]
    )
    took = ended - float(killed_at.read_text())
    print(f"rank 1 SIGKILLed -> torchrun returned after {took:.1f} s (train.rank_timeout_s=30)")
    assert took < 30  # the kill, rank 0's line and exit, torchrun's report: within the timeout
    assert (out / "checkpoints" / "step_00000004" / "COMPLETE").is_file() and not (out / "report.json").exists()

    one_rank = tmp_path / "one_rank"
    shutil.copytree(out, one_rank)
    resumed = run_main(base_args(tiny_target, chats, out, resume="auto", **extra), torchrun=2)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]
    a, b = weights(reference), weights(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    single = {**extra, "train.grad_accum": "2"}
    assert run_script(MAIN, base_args(tiny_target, chats, one_rank, resume="auto", **single), monkeypatch) == 0
    assert run_script(MAIN, base_args(tiny_target, chats, tmp_path / "one_rank_reference", **single), monkeypatch) == 0
    c, d = weights(one_rank), weights(tmp_path / "one_rank_reference")
    assert losses(one_rank)[:4] == losses(reference)[:4]  # the 2-rank steps, kept
    for k in d:
        torch.testing.assert_close(c[k], d[k], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_torchrun_sent_sigterm_forwards_it_and_returns_1_after_its_worker_saved_the_checkpoint(
    tiny_target, chats, tmp_path
):
    """What a Slurm script sees (README, Preemption): torchrun itself signalled forwards SIGTERM to its workers, waits
    for them (up to --shutdown-timeout), then ends with its own traceback and exit code 1, not the workers' 143."""
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "1",
        "--master-port",
        str(free_ports(1)[0]),
    ]
    cmd = [
        *torchrun,
        str(MAIN),
        *base_args(tiny_target, chats, out, **{"train.max_steps": "200", "export.formats": "[eagle3]"}),
    ]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not (out / "checkpoints" / "step_00000002" / "COMPLETE").exists():
        assert proc.poll() is None and time.time() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr[-3000:]
    assert "SignalException: Process" in stderr and "got signal: 15" in stderr
    stopped = [x for x in stderr.splitlines() if x.startswith("error: stopped by SIGTERM at step ")]
    assert len(stopped) == 1, stderr[-3000:]
    step = int(stopped[0].split("at step ")[1].split(":")[0])
    assert (out / "checkpoints" / f"step_{step:08d}" / "COMPLETE").is_file() and not (out / "report.json").exists()


# an MLA drafter (eagle31.attention.mla) of explicit shape on the tiny target: FSDP2 shards it like the Llama one
MLA_DRAFTER = {
    "drafter.attention": "mla",
    "drafter.mla.q_lora_rank": "8",
    "drafter.mla.kv_lora_rank": "8",
    "drafter.mla.qk_nope_head_dim": "4",
    "drafter.mla.qk_rope_head_dim": "4",
    "drafter.mla.v_head_dim": "4",
    "export.formats": "[eagle3]",
}


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["llama", "mla"])
def test_torchrun_two_processes_match_one_process_with_the_same_global_batch(tiny_target, chats, tmp_path, drafter):
    extra = {"train.max_steps": "3", **(MLA_DRAFTER if drafter == "mla" else {})}
    one = run_main(base_args(tiny_target, chats, tmp_path / "one", **extra, **{"train.grad_accum": "2"}))
    assert one.returncode == 0, one.stderr[-3000:]
    two = run_main(base_args(tiny_target, chats, tmp_path / "two", **extra), torchrun=2)
    assert two.returncode == 0, two.stderr[-3000:]
    torch.testing.assert_close(
        torch.tensor(losses(tmp_path / "two")), torch.tensor(losses(tmp_path / "one")), rtol=1e-5, atol=1e-6
    )


@pytest.mark.slow
def test_two_processes_under_nccl_device_rule_train_evaluate_resume_and_export(tiny_target, chats, tmp_path):
    """torchrun on CPU with every collective refusing host tensors the way NCCL does (tests/nccl_standin.py)."""
    out, report = tmp_path / "run", tmp_path / "checked"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "NCCL_STANDIN_REPORT": str(report)}
    worker = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(REPO / "tests" / "nccl_worker.py"),
    ]
    extra = {"train.max_steps": "4", "train.eval_every": "2", "train.save_every": "2"}
    first = subprocess.run(
        [*worker, *base_args(tiny_target, chats, out, **extra)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=REPO,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    extra.update({"train.max_steps": "6", "resume": "auto"})
    second = subprocess.run(
        [*worker, *base_args(tiny_target, chats, out, **extra)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=REPO,
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout
    assert json.loads((out / "report.json").read_text())["steps"] == 6
    assert (out / "export" / "eagle3" / "model.safetensors").is_file() and (
        out / "export" / "speculators" / "config.json"
    ).is_file()
    for rank in (0, 1):  # both launches went through the checks: the step's sums, DCP's object collectives
        for line in Path(f"{report}.rank{rank}.json").read_text().splitlines():
            checked = json.loads(line)
            assert checked["torch.distributed.all_reduce"] > 0 and checked["torch.distributed.all_gather"] > 0, checked


@pytest.mark.slow
def test_torchrun_sequence_parallel_under_the_nccl_device_rule_trains_as_one_process_and_resumes_with_1_and_4(
    reference_run, tiny_target, chats, tmp_path, monkeypatch, capsys
):
    """train.sequence_parallel=2 on 2 ranks (each sequence split in two) trains, checkpoints, evaluates and exports
    what one process does with the whole sequence, every collective held to NCCL's device rule; its step-4
    checkpoint resumed in one process (sequence_parallel=1) and on 4 ranks (sequence_parallel=4) ends with the
    same weights: DCP reshards."""
    import shutil

    out, report = tmp_path / "run", tmp_path / "checked"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "NCCL_STANDIN_REPORT": str(report)}
    worker = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(REPO / "tests" / "nccl_worker.py"),
    ]
    done = subprocess.run(
        [*worker, *base_args(tiny_target, chats, out, **{"train.sequence_parallel": "2"})],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "export" / "eagle3" / "model.safetensors").is_file() and (
        out / "export" / "speculators" / "config.json"
    ).is_file()
    torch.testing.assert_close(torch.tensor(losses(out)), torch.tensor(losses(reference_run)), rtol=1e-5, atol=1e-6)
    a, b = weights(reference_run), weights(out)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)
    for rank in (0, 1):  # the shards' exchanges went through the checks
        checked = json.loads(Path(f"{report}.rank{rank}.json").read_text().splitlines()[-1])
        assert (
            checked["torch.distributed.all_gather_single"] > 0
            and checked["torch.distributed.reduce_scatter_single"] > 0
        ), checked

    # the run as it was after step 4, resumed at sequence_parallel=1 and at 4
    for done_part in ("report.json", "drafter", "export", "checkpoints/step_00000006"):
        path = out / done_part
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    out4 = tmp_path / "run4"
    shutil.copytree(out, out4)
    worker4 = [*worker[:-2], "4", worker[-1]]
    done = subprocess.run(
        [*worker4, *base_args(tiny_target, chats, out4, resume="auto", **{"train.sequence_parallel": "4"})],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {out4 / 'checkpoints' / 'step_00000004'} (step 4)" in done.stdout + done.stderr
    b = weights(out4)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)
    capsys.readouterr()
    assert run_script(MAIN, base_args(tiny_target, chats, out, resume="auto"), monkeypatch) == 0
    assert f"resumed from {out / 'checkpoints' / 'step_00000004'} (step 4)" in capsys.readouterr().out
    b = weights(out)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.tensor(losses(out)), torch.tensor(losses(reference_run)), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- dry run


@pytest.mark.slow
def test_kimi_k26_dry_run_needs_no_weights(monkeypatch, capsys):
    code = run_script(MAIN, ["recipe=kimi_k26", "dry_run=true"], monkeypatch)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "config valid" in out and "GiB" in out and "attention=mla" in out


@pytest.mark.parametrize("recipe", ["kimi_k26", "kimi_k26_llama"])
def test_kimi_k26_drafters_have_the_published_shapes(recipe):
    from eagle31.distributed import init_world
    from eagle31.estimate import count_parameters
    from eagle31.plan import plan_run
    from eagle31.recipe import load_recipe

    plan = plan_run(load_recipe(REPO / "recipes", [f"recipe={recipe}", "dry_run=true"]), init_world("cpu"))
    d, counts = plan.drafter, count_parameters(plan.drafter)
    assert counts.frozen_embedding == 163840 * 7168
    assert d.aux_layer_ids == (2, 30, 58) and d.fc_norm and d.norm_output
    if recipe == "kimi_k26":  # lightseekorg/kimi-k2.6-eagle3.1-mla: MLA, I 18432, full vocabulary
        assert (
            d.attention,
            d.mla.q_lora_rank,
            d.mla.kv_lora_rank,
            d.mla.qk_nope_head_dim,
            d.mla.qk_rope_head_dim,
            d.mla.v_head_dim,
        ) == ("mla", 1536, 512, 128, 64, 128)
        assert (d.intermediate_size, d.draft_vocab_size) == (18432, 163840)
        # fc 21504x7168, MLA 116M, MLP 3x7168x18432, lm_head 163840x7168 (1.17B of the 1.84B)
        assert 1.83e9 < counts.trainable < 1.85e9, counts
    else:  # fc 21504x7168, q/k/v 14336x8192, o 8192x7168, MLP 3x7168x12288, lm_head 32000x7168
        assert d.attention == "llama" and 1.0e9 < counts.trainable < 1.2e9, counts


@pytest.mark.slow
def test_dry_run_plans_for_the_given_gpus_and_prints_the_longest_length(capsys):
    """8 GPUs of 80 GB: the optimizer states sharded 8 ways, the longest T the boundary of the estimate, 64k
    tokens and more (80 GB cards hold the published drafter at 64k tokens)."""
    from eagle31.distributed import init_world
    from eagle31.estimate import count_parameters
    from eagle31.plan import describe_dry_run, plan_run
    from eagle31.recipe import load_recipe

    args = ["recipe=kimi_k26", "dry_run=true", "plan.world_size=8", "plan.gpu_memory_gib=80"]
    plan = plan_run(load_recipe(REPO / "recipes", args), init_world("cpu"))
    report = describe_dry_run(plan)
    assert report["world_size"] == 8 and report["memory_gib_per_gpu"]["total"] < 60
    longest = report["longest_seq_len_per_gpu_gib"]["80"]
    trainable = count_parameters(plan.drafter).trainable
    assert report["memory_gib_per_gpu"]["weights_and_optimizer_states"] == pytest.approx(trainable * 12 / 8 / 2**30)
    assert longest >= 65536 and f"longest T that fits 8 GPU(s) of 80 GiB: {longest:,}" in capsys.readouterr().out


def test_dry_run_refuses_a_negative_plan(capsys):
    from eagle31.pipeline import run
    from eagle31_cli import recipe_main

    assert recipe_main(run, REPO / "recipes", ["recipe=kimi_k26", "dry_run=true", "plan.world_size=-1"]) == 2
    assert "plan.world_size and plan.gpu_memory_gib must be >= 0" in capsys.readouterr().err


def test_an_mla_run_asking_for_the_speculators_layout_is_refused_at_plan_time():
    from eagle31 import ConfigError
    from eagle31.distributed import init_world
    from eagle31.plan import plan_run
    from eagle31.recipe import load_recipe

    cfg = load_recipe(REPO / "recipes", ["recipe=kimi_k26", "dry_run=true", "export.formats=[eagle3,speculators]"])
    with pytest.raises(ConfigError, match="'speculators' cannot carry an MLA drafter"):
        plan_run(cfg, init_world("cpu"))


# ---------------------------------------------------------------------------- bad input


def one_line_error(args: list[str], monkeypatch, capsys) -> str:
    """Run `train/main.py <args>` in-process; it must refuse with exit 2 and one line on stderr."""
    code = run_script(MAIN, args, monkeypatch)
    err = capsys.readouterr().err
    assert code == 2, (code, err[-2000:])
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    "extra, expected",
    [
        ({"recipe": "no_such_recipe"}, "recipe/no_such_recipe"),
        ({"train.no_such_field": "1"}, "no_such_field"),
        ({"target.path": "/no/such/target"}, "/no/such/target"),
        ({"drafter.aux_layer_ids": "[2,4,9]"}, "aux_layer_ids"),
        ({"data.source": "[/no/such/chats.jsonl]"}, "/no/such/chats.jsonl"),
        ({"train.sequence_parallel": "2"}, "train.sequence_parallel=2 must be >= 1 and divide the world size 1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_any_model(
    tiny_target, chats, tmp_path, extra, expected, monkeypatch, capsys
):
    out = tmp_path / "run"
    line = one_line_error(base_args(tiny_target, chats, out, **extra), monkeypatch, capsys)
    assert expected in line
    assert not (out / "checkpoints").exists()


def test_all_masked_dataset_is_refused(tiny_target, tmp_path, monkeypatch, capsys):
    data = write_jsonl(tmp_path / "only_users.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 4)
    line = one_line_error(base_args(tiny_target, data, tmp_path / "run"), monkeypatch, capsys)
    assert "only_users.jsonl" in line or "no sample" in line


def test_output_dir_holding_another_run_is_refused(reference_run, tiny_target, chats, monkeypatch, capsys):
    line = one_line_error(base_args(tiny_target, chats, reference_run), monkeypatch, capsys)
    assert "resume=auto" in line
    line = one_line_error(
        base_args(tiny_target, chats, reference_run, **{"resume": "auto", "train.ttt_length": "2"}), monkeypatch, capsys
    )
    assert "train.ttt_length" in line


def test_store_made_for_another_target_is_refused(reference_run, tiny_target, chats, tmp_path, monkeypatch, capsys):
    import numpy as np

    from eagle31.data.store import StoreHeader, StoreWriter

    store = tmp_path / "features"
    header = StoreHeader(
        target_name="another",
        target_revision=None,
        num_layers=8,
        hidden_size=48,
        aux_layer_ids=(2, 4, 5),
        dtype="float32",
    )
    StoreWriter(store / "train", header, np.arange(1), np.array([4]), 1024)
    extra = {"features.mode": "store", "features.store_dir": str(store)}
    line = one_line_error(base_args(tiny_target, chats, tmp_path / "run", **extra), monkeypatch, capsys)
    assert "store" in line
