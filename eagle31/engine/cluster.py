"""Ray for the engine: imported only when asked for (one line when it is missing), joined or started, left.

A run with `features.engine.address` joins that cluster (`auto`: the one started on this node by
`ray start`); without it rank 0 starts a cluster on its node, the other ranks join it, and rank 0
stops it at the end. The actors eagle31 starts import the same `eagle31` as the process that
starts them (`actor_runtime_env`), so a source checkout runs as an installed package does; on a
cluster of several nodes each node needs eagle31 and its dependencies installed, as Ray expects.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from eagle31.errors import ConfigError

AUTH_MODE = "RAY_AUTH_MODE"  # Ray's switch for token authentication, which ray.init sets when it starts a cluster
NAMESPACE = "eagle31"  # the named actors of a run (its feature pool) live here, whoever started Ray
RAY_MISSING = "features.mode=engine needs Ray, which is not installed: pip install 'eagle31[engine]' (ray>=2.40)"


def check_ray_installed() -> None:
    """One line when Ray is not installed (checked before any model is built; Ray itself is not imported here)."""
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
    """`ray.init(**kwargs)` that leaves this process's SIGTERM handler as it was. Ray's init installs its own
    (exit at once) and its shutdown does not put the old one back: without this a SIGTERM to an engine run
    would skip the preemption checkpoint, and every later run in the process would inherit Ray's handler."""
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


@contextmanager
def ray_session(
    address: str | None, num_cpus: int | None, auth_mode: str | None = None
) -> Iterator[tuple[str, str | None]]:
    """Join the cluster at `address`, or start one on this node with `num_cpus` CPUs (None: all); yields what
    the other ranks join it with: (address, Ray's authentication mode). A cluster that Ray started with token
    authentication (its default) is joined in that mode (`auth_mode`): a process joining by address alone
    would not send the token. A process already connected to Ray (a test's cluster) stays connected."""
    if auth_mode and AUTH_MODE not in os.environ:
        os.environ[AUTH_MODE] = auth_mode  # read by Ray when it is imported, so before that
    ray = import_ray()
    joined = not ray.is_initialized()
    if joined:
        where = {"address": address} if address else {"num_cpus": num_cpus, "include_dashboard": False}
        try:
            init_ray(ray, namespace=NAMESPACE, logging_level=logging.ERROR, log_to_driver=False, **where)
        except ConnectionError as e:
            cause = f": {str(e.__cause__).splitlines()[-1]}" if e.__cause__ else ""
            raise ConfigError(
                f"features.engine.address={address}: cannot join the Ray cluster ({str(e).splitlines()[0]}{cause})"
            ) from None
    try:
        yield ray.get_runtime_context().gcs_address, os.environ.get(AUTH_MODE)
    finally:
        if joined:
            ray.shutdown()  # stops the cluster this process started; leaves a joined one running
