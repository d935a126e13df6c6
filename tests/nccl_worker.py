"""`train/main.py` under the NCCL stand-in (tests/nccl_standin.py), for torchrun on CPU machines.

    python -m torch.distributed.run --nproc-per-node 2 tests/nccl_worker.py recipe=... train.device=cpu

The stand-in learns the world's device from `eagle31.distributed.init_world`, the one place the
trainer declares it, and refuses from then on every collective handed a tensor that is not there.
"""

import atexit
import json
import os
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import eagle31.distributed  # noqa: E402
from tests.nccl_standin import CHECKED, install  # noqa: E402

_init_world = eagle31.distributed.init_world


def init_world(device: str = "auto", rank_timeout_s=None):
    world = _init_world(device, rank_timeout_s)
    install(world.device)
    return world


def report_checked() -> None:
    """Which collectives were checked, for the test to see that the stand-in was in the way."""
    out = os.environ.get("NCCL_STANDIN_REPORT")
    if out:
        with open(f"{out}.rank{os.environ.get('RANK', '0')}.json", "a") as f:
            f.write(json.dumps(dict(CHECKED)) + "\n")


atexit.register(report_checked)
eagle31.distributed.init_world = init_world  # before train/main.py imports the pipeline
sys.argv[0] = str(REPO / "train" / "main.py")
runpy.run_path(sys.argv[0], run_name="__main__")
