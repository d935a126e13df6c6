"""Ray for the engine: imported only when asked for, joined or started on the trainers' node, left."""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from eagle31.errors import ConfigError

AUTH_MODE = "RAY_AUTH_MODE"  # Ray's switch for token authentication, which ray.init sets when it starts a cluster
NAMESPACE = "eagle31"  # the named actors of a run (its feature pool) live here, whoever started Ray
RAY_MISSING = "features.mode=engine needs Ray, which is not installed: pip install 'eagle31[engine]' (ray>=2.40)"


def check_ray_installed() -> None:
    """One line when Ray is not installed, without importing it."""
    if importlib.util.find_spec("ray") is None:
        raise ConfigError(RAY_MISSING)


def import_ray():
    """The `ray` module, or the one line of `check_ray_installed`."""
    try:
        import ray
    except ImportError:
        raise ConfigError(RAY_MISSING) from None
    return ray


def init_ray(ray, **kwargs) -> None:
    """`ray.init(**kwargs)` that keeps this process's SIGTERM handler (Ray's would skip the preemption checkpoint)."""
    main = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGTERM) if main else None
    try:
        ray.init(**kwargs)
    finally:
        if main:
            signal.signal(signal.SIGTERM, before)


def actor_runtime_env() -> dict:
    """Ray's runtime environment for eagle31's actors: this process's `eagle31` first on their path."""
    import eagle31

    root = str(Path(eagle31.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {"env_vars": {"PYTHONPATH": path}}


def lendable_gpus(visible: str | None, count: int, trainer_gpus: int) -> list[str]:
    """The GPU ids visible here (CUDA_VISIBLE_DEVICES; None: all `count`) after the trainers' first `trainer_gpus`."""
    ids = [str(i) for i in range(count)] if visible is None else [i.strip() for i in visible.split(",") if i.strip()]
    return ids[trainer_gpus:]


def check_worker_gpus(lendable: list[str], trainer_gpus: int, workers: int, worker_gpus: float) -> None:
    """One line when the workers ask for more GPUs than a cluster started on this node is lent."""
    if workers * worker_gpus > len(lendable):
        raise ConfigError(
            f"features.engine.workers={workers} x worker_gpus={worker_gpus:g} need {workers * worker_gpus:g} GPU(s); "
            f"the Ray cluster started on this node is lent {len(lendable)} (its visible GPUs, CUDA_VISIBLE_DEVICES, "
            f"less the {trainer_gpus} its trainers use): lower features.engine.workers or worker_gpus, or run the "
            "workers on other nodes (features.engine.address)"
        )


def check_joined_node(node_gpus: float, lendable: list[str], trainer_gpus: int, address: str) -> None:
    """One line when this node lends a joined cluster more GPUs than its trainers leave."""
    if trainer_gpus and node_gpus > len(lendable):
        raise ConfigError(
            f"features.engine.address={address}: this node lends Ray {node_gpus:g} GPU(s), but its {trainer_gpus} "
            f"trainer(s) use {trainer_gpus} of its {trainer_gpus + len(lendable)} visible GPU(s), so a worker could be "
            f"placed on a trainer's; start Ray on this node with --num-gpus {len(lendable)} and CUDA_VISIBLE_DEVICES "
            "naming the GPUs the trainers leave (none: --num-gpus 0)"
        )


class RaySession(NamedTuple):
    address: str  # what the other ranks join (the cluster's GCS address)
    auth_mode: str | None  # Ray's authentication mode, which they join in
    how: str  # for the log: started or joined, where


@contextmanager
def ray_session(
    address: str | None, num_cpus: int | None, auth_mode: str | None = None, gpus: Sequence[str] = ()
) -> Iterator[RaySession]:
    """Join the cluster at `address` (with its `auth_mode`), or start one here with `num_cpus` CPUs and GPUs `gpus`."""
    if auth_mode and AUTH_MODE not in os.environ:
        os.environ[AUTH_MODE] = auth_mode  # read by Ray when it is imported, so before that
    ray = import_ray()
    connects = not ray.is_initialized()  # else a test's cluster: left as it is
    if connects:
        options = dict(namespace=NAMESPACE, logging_level=logging.ERROR, log_to_driver=False)
        try:
            if address:
                init_ray(ray, address=address, **options)
            else:
                with visible_gpus(gpus):  # the raylet, and every worker it starts, sees these alone
                    init_ray(
                        ray, address="local", num_cpus=num_cpus, num_gpus=len(gpus), include_dashboard=False, **options
                    )
        except ConnectionError as e:
            cause = f": {str(e.__cause__).splitlines()[-1]}" if e.__cause__ else ""
            raise ConfigError(
                f"features.engine.address={address}: cannot join the Ray cluster ({str(e).splitlines()[0]}{cause})"
            ) from None
    here = ray.get_runtime_context().gcs_address
    if not connects:
        how = f"uses the Ray cluster this process is connected to ({here})"
    elif address:
        how = f"joined the Ray cluster at features.engine.address={address} ({here})"
    else:
        cpus = "all" if num_cpus is None else num_cpus
        how = f"started a Ray cluster on this node at {here} ({cpus} CPUs, GPUs: {','.join(gpus) or 'none'})"
    try:
        yield RaySession(here, os.environ.get(AUTH_MODE), how)
    finally:
        if connects:
            ray.shutdown()  # stops the cluster this process started; leaves a joined one running


@contextmanager
def visible_gpus(ids: Sequence[str]) -> Iterator[None]:
    """CUDA_VISIBLE_DEVICES set to `ids` for the processes started meanwhile; as it was afterwards."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(ids)
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before
