"""scripts/slurm/engine.sbatch on a real single-node Slurm (Debian's slurmctld and slurmd, which this test starts on
free ports with a slurm.conf of its own, and stops whatever happens): the job trains at a tiny size on the CPU,
is told its time is nearly up (SIGUSR1, as `--signal=B:USR1@600` sends), checkpoints, requeues itself, and the
requeued job resumes and finishes the run."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle31.engine.transport import free_ports
from tests.helpers import base_args
from tests.peers import missing_peer

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "slurm" / "engine.sbatch"
START_S = 60  # the daemons' start


def slurm_conf(tmp: Path, host: str, ctld_port: int, d_port: int) -> str:
    """One node (this machine, 2 CPUs), no munge (auth/none), state and logs under `tmp`; KillWait above the
    trainers' train.preempt_grace_s (60 s)."""
    return f"""ClusterName=eagle31test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={tmp}/state
SlurmdSpoolDir={tmp}/spool
SlurmctldPidFile={tmp}/slurmctld.pid
SlurmdPidFile={tmp}/slurmd.pid
SlurmctldLogFile={tmp}/slurmctld.log
SlurmdLogFile={tmp}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
KillWait=70
NodeName={host} NodeAddr=127.0.0.1 CPUs=2 RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture
def slurm(tmp_path):
    """The environment of a running single-node Slurm (SLURM_CONF); its daemons stopped at the end."""
    if not (shutil.which("slurmctld") and shutil.which("slurmd") and shutil.which("sbatch")):
        missing_peer("no Slurm (slurmctld, slurmd, sbatch): apt-get install slurmctld slurmd slurm-client")
    if os.geteuid() != 0:
        pytest.skip("the test's Slurm runs its daemons as root")
    tmp = tmp_path / "slurm"
    for sub in ("state", "spool"):
        (tmp / sub).mkdir(parents=True)
    host = socket.gethostname().split(".")[0]
    conf = tmp / "slurm.conf"
    conf.write_text(slurm_conf(tmp, host, *free_ports(2)))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons = [subprocess.Popen([daemon, "-D", "-f", str(conf), *extra], env=env, stdout=log, stderr=subprocess.STDOUT)
               for daemon, extra, log in (("slurmctld", [], open(tmp / "ctld.out", "wb")),
                                          ("slurmd", ["-N", host], open(tmp / "d.out", "wb")))]  # fmt: skip
    try:
        deadline = time.monotonic() + START_S
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True).stdout:
            assert all(d.poll() is None for d in daemons), (tmp / "slurmctld.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "Slurm's node did not come up"
            time.sleep(0.5)
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--user=root"], env=env, capture_output=True, timeout=30)
        for d in daemons:
            d.send_signal(signal.SIGTERM)
        for d in daemons:
            try:
                d.wait(timeout=30)
            except subprocess.TimeoutExpired:
                d.kill()
                d.wait()


def job_field(env: dict, job: str, field: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    return next((w.split("=", 1)[1] for w in out.split() if w.startswith(f"{field}=")), "")


def wait_for(what: str, done, deadline: float, log: Path) -> None:
    """Poll `done` until it holds; past `deadline` (time.monotonic()), fail with the job's log."""
    while not done():
        assert time.monotonic() < deadline, f"{what} did not happen in the test's time; the job's log:\n" + (
            log.read_text()[-4000:] if log.exists() else "(none)"
        )
        time.sleep(1)


@pytest.mark.slow  # two starts of a one-node job: Ray, the engine, 240 steps; 1 to 3 minutes on 2 cores
@pytest.mark.deadline(1200)
def test_the_engine_job_checkpoints_requeues_itself_and_resumes_to_the_end(slurm, tiny_target, chats, tmp_path):
    out = tmp_path / "run"
    log = tmp_path / "job.out"
    extra = {"export.formats": "[eagle3]", "features.engine.worker_cpus": "0.5", "train.max_steps": "240"}
    # 240 steps: the first start must still be training when the test, polling each second, sees a checkpoint
    # and signals it (on two idle cores the tiny run trains about 4 steps a second)
    args = base_args(tiny_target, chats, out, **extra)
    env = {**slurm, "PYTHON": sys.executable, "RAY_PORT": str(free_ports(1)[0]), "RAY_START_TIMEOUT_S": "120",
           "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}  # fmt: skip
    job = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", "--cpus-per-task=2", f"--output={log}",
         "--export=ALL", str(SCRIPT), *args],
        cwd=REPO, env=env, capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()  # fmt: skip

    deadline = time.monotonic() + 840  # one budget for the three waits: a slow start leaves the later ones less
    # any complete checkpoint: the run keeps its last two, so the first may be gone before the next poll
    wait_for("a checkpoint", lambda: any((out / "checkpoints").glob("step_*/COMPLETE")), deadline, log)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, check=True, timeout=30)  # time nearly up

    def requeued() -> bool:
        assert not (out / "report.json").exists(), "the first start finished before the signal: give it more steps"
        return job_field(env, job, "Restarts") == "1" and job_field(env, job, "JobState") == "PENDING"

    wait_for("the requeue", requeued, deadline, log)
    subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], env=env, check=True, timeout=30)
    wait_for(
        "the end of the job", lambda: job_field(env, job, "JobState") in ("COMPLETED", "FAILED", ""), deadline, log
    )

    said = log.read_text()
    assert job_field(env, job, "JobState") == "COMPLETED", said[-4000:]
    assert "eagle31: SIGUSR1: the trainers checkpoint their step and stop" in said
    assert "stopped by SIGTERM at step" in said  # the trainers' own line: a complete checkpoint of a step mid-run
    assert f"requeueing job {job}" in said and f"job {job}, start 2" in said
    assert "resumed from " in said and "eagle31: the run has finished" in said
    assert (out / "report.json").is_file()
    assert not list(Path("/tmp").glob(f"ray-eagle31-{job}-*"))  # each start's Ray files went with it
