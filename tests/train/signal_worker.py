"""`train/main.py` with a signal delivered to one rank during one step, for the preemption and dead-rank tests.

    SIGNAL_AT=<rank>:<step>:<SIGNAME>[:<times>] python tests/train/signal_worker.py <overrides...>
    SIGNAL_AT=1:4:SIGKILL python -m torch.distributed.run --nproc-per-node 2 tests/train/signal_worker.py ...

Rank <rank> sends itself the signal while computing step <step> (1-based); for a stop signal it
then waits until the run's `StopSignals` has read it, so the loop sees it after that very step,
and sends the <times>-1 others once each would count as a new signal. `signal_during_step` can
send it while saving the checkpoint of step <step> or evaluating after it instead.
`SIGNAL_AT_LOG` names a file that gets the time of the signal.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def signal_during_step(
    monkeypatch,
    step: int,
    sig: signal.Signals = signal.SIGTERM,
    times: int = 1,
    log: str | None = None,
    during: str = "train_step",
) -> None:
    """Patch the trainer (through `monkeypatch`) so that this process gets `sig` `times` times during step `step`
    (`during="train_step"`), or while saving its checkpoint or evaluating after it (`"save_checkpoint"`,
    `"evaluate"`)."""
    import eagle31.pipeline
    from eagle31.preemption import StopSignals
    from eagle31.trainer import Trainer

    entered: list[StopSignals] = []

    class Recorded(StopSignals):
        def __enter__(self):
            entered.append(self)
            return super().__enter__()

    real = getattr(Trainer, during)
    at = step - 1 if during == "train_step" else step  # the trainer's step counter while it runs

    def signalled(self, *args):
        if self.state.step == at:
            if log:
                Path(log).write_text(f"{time.time()}\n")
            os.kill(os.getpid(), sig)
            deadline = time.time() + 30
            while not entered[-1].requested:  # the signal thread has read it: the loop sees it after this step
                assert time.time() < deadline, "the stop signal was not seen"
                time.sleep(0.01)
            for _ in range(times - 1):  # a second signal after the window in which it counts as the same one
                time.sleep(entered[-1].same_within_s + 0.5)
                os.kill(os.getpid(), sig)
        return real(self, *args)

    monkeypatch.setattr(eagle31.pipeline, "StopSignals", Recorded)
    monkeypatch.setattr(Trainer, during, signalled)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    import pytest

    rank, step, name, *times = os.environ["SIGNAL_AT"].split(":")
    if int(os.environ.get("RANK", "0")) == int(rank):
        signal_during_step(
            pytest.MonkeyPatch(),
            int(step),
            signal.Signals[name],
            int(times[0]) if times else 1,
            os.environ.get("SIGNAL_AT_LOG"),
        )
    sys.argv = [str(REPO / "train" / "main.py"), *sys.argv[1:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
