"""How features travel from the workers to the trainers: Ray's object store, or a Mooncake store (docs/engine.md)."""

from __future__ import annotations

import ctypes
import importlib
import math
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from enum import StrEnum
from functools import partial
from pathlib import Path
from urllib.parse import urlparse

import torch

from eagle31.distributed import free_ports
from eagle31.errors import ConfigError, EngineError


class Transport(StrEnum):
    """How features travel from the workers to the trainers (`features.engine.transport`)."""

    ray = "ray"  # Ray's object store
    mooncake = "mooncake"  # a Mooncake distributed store (pip install mooncake-transfer-engine-non-cuda)


class MooncakeProtocol(StrEnum):
    """What carries Mooncake's bytes (`features.engine.mooncake_protocol`)."""

    tcp = "tcp"
    rdma = "rdma"  # InfiniBand or RoCE NICs (`features.engine.mooncake_rdma_devices`)


MOONCAKE_MISSING = (
    "features.engine.transport=mooncake needs Mooncake, which is not installed: "
    "pip install mooncake-transfer-engine-non-cuda (mooncake-transfer-engine on CUDA machines)"
)
IBVERBS_MISSING = (
    "features.engine.transport=mooncake: Mooncake's library needs libibverbs, which is not installed "
    "(Debian/Ubuntu: apt-get install libibverbs1; RHEL: dnf install libibverbs)"
)
OBJECT_NOT_FOUND = -704  # Mooncake's code for a key it does not hold (a removal of a key already gone)
LEASE_EXPIRED = -707  # a read whose lease ran out before the transfer ended: the bytes are there, read again
MASTER_START_S = 60.0  # the most a master rank 0 starts may take to listen
CONNECT_S = 5.0  # a probe of the master's ports


def import_store():
    """`mooncake.store`, or the one line that says what is missing."""
    try:
        return importlib.import_module("mooncake.store")
    except ImportError as e:
        raise ConfigError(IBVERBS_MISSING if "libibverbs" in str(e) else MOONCAKE_MISSING) from None


def check_transport(e) -> None:
    """transport=mooncake (`e`: features.engine): Mooncake importable, and a given master and metadata server answer."""
    if e.transport != Transport.mooncake:
        return
    import_store()
    if bool(e.mooncake_master) != bool(e.mooncake_metadata_server):
        names = ["mooncake_master", "mooncake_metadata_server"]
        given, missing = names if e.mooncake_master else names[::-1]
        raise ConfigError(
            f"features.engine.{given} is set but features.engine.{missing} is not: a Mooncake master is named by both "
            "(host:port of its RPC, http://host:port/metadata of its metadata server); leave both unset and rank 0 "
            "starts one"
        )
    if e.mooncake_master:
        check_reachable(given_master(e))


def given_master(e) -> MooncakeAddress:
    """The store `features.engine.mooncake_master` and `mooncake_metadata_server` name."""
    return MooncakeAddress(e.mooncake_master, e.mooncake_metadata_server, e.mooncake_protocol, e.mooncake_rdma_devices)


def master_binary() -> Path:
    """The `mooncake_master` executable that ships in Mooncake's wheel."""
    import_store()
    import mooncake

    binary = Path(mooncake.__file__).parent / "mooncake_master"
    if not binary.is_file():
        raise ConfigError(f"features.engine.transport=mooncake: the Mooncake install has no master binary at {binary}")
    return binary


# ---------------------------------------------------------------------------- where the store is


@dataclass(frozen=True)
class MooncakeAddress:
    """Where a run's store is, and how its bytes travel (picklable: every client of the run gets it)."""

    master: str  # host:port of mooncake_master's RPC
    metadata_server: str  # http://host:port/metadata
    protocol: str = MooncakeProtocol.tcp
    rdma_devices: str = ""  # protocol=rdma: NIC names, e.g. "mlx5_0,mlx5_1" ("": Mooncake's choice)
    named: str = ""  # how the lines that name it say where it is (default: features.engine.mooncake_master=...)

    def __str__(self) -> str:
        return self.named or f"features.engine.mooncake_master={self.master}"


def check_reachable(address: MooncakeAddress) -> None:
    """One line when the master's RPC port or its metadata server does not accept a connection."""
    url = urlparse(address.metadata_server)
    metadata = f"features.engine.mooncake_metadata_server={address.metadata_server}"
    if url.scheme != "http" or not url.hostname or not url.port:
        raise ConfigError(f"{metadata} is not an http://host:port/metadata URL")
    host, _, port = address.master.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"{address} is not host:port")
    for named, where in ((str(address), (host, int(port))), (metadata, (url.hostname, url.port))):
        try:
            socket.create_connection(where, timeout=CONNECT_S).close()
        except OSError as e:
            raise ConfigError(f"{named}: cannot reach the Mooncake master ({e})") from None


@contextmanager
def mooncake_master(host: str, protocol: str, rdma_devices: str = "") -> Iterator[MooncakeAddress]:
    """A `mooncake_master` here on free ports with its HTTP metadata server, reached at `host` (this node's address)."""
    rpc, http, metrics = free_ports(3)
    ports = f"--rpc_port={rpc} --http_metadata_server_port={http} --metrics_port={metrics}".split()
    # a long lease: reads never race one (removal is forced anyway)
    args = [str(master_binary()), *ports, "--enable_http_metadata_server=true", "--default_kv_lease_ttl=600000"]
    die_with_parent = partial(ctypes.CDLL("libc.so.6").prctl, 1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG, in the child
    with tempfile.TemporaryDirectory(prefix="eagle31-mooncake-") as tmp:
        log_path = Path(tmp) / "mooncake_master.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent
            )
        named = f"the Mooncake master rank 0 started at {host}:{rpc}"
        address = MooncakeAddress(f"{host}:{rpc}", f"http://{host}:{http}/metadata", protocol, rdma_devices, named)
        try:
            _wait_listening(process, [rpc, http], log_path)
            yield address
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_listening(process: subprocess.Popen, ports: list[int], log_path: Path) -> None:
    deadline = time.monotonic() + MASTER_START_S
    master = "features.engine.transport=mooncake: the Mooncake master rank 0 started"
    for port in ports:
        while True:
            if process.poll() is not None:
                lines = [x for x in log_path.read_text(errors="replace").splitlines() if x.strip()]
                last = lines[-1] if lines else "no output"
                raise ConfigError(f"{master} exited ({process.returncode}): {last}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise ConfigError(f"{master} does not listen on port {port} after {MASTER_START_S:g} s") from None
                time.sleep(0.05)


# ---------------------------------------------------------------------------- one process's client


class MooncakeClient:
    """One process's zero-copy client of the store, lending it `segment_bytes` of this process's memory (0: none)."""

    def __init__(self, address: MooncakeAddress, hostname: str, segment_bytes: int = 0, buffer_bytes: int = 16 << 20):
        self.address = address
        store = import_store()
        self.store = store.MooncakeDistributedStore()
        where = (address.metadata_server, int(segment_bytes), int(buffer_bytes), str(address.protocol))
        rc = self.store.setup(hostname, *where, address.rdma_devices, address.master)
        if rc != 0:
            join = f"cannot join the Mooncake store of {address} over {address.protocol} from {hostname}"
            raise EngineError(f"{join} (setup returned {rc})")
        self.pinned = store.ReplicateConfig()
        self.pinned.with_hard_pin = True  # never evicted: only the pool removes a key

    @contextmanager
    def _registered(self, tensors: Sequence[torch.Tensor]) -> Iterator[None]:
        with ExitStack() as registered:
            for t in tensors:  # non-empty: the callers leave empty ones out
                rc = self.store.register_buffer(t.data_ptr(), t.nbytes)
                if rc != 0:
                    raise EngineError(f"Mooncake cannot register {t.nbytes} bytes (error {rc})")
                registered.callback(self.store.unregister_buffer, t.data_ptr())
            yield

    def put(self, key: str, tensors: Sequence[torch.Tensor]) -> None:
        """One object under `key`: the bytes of `tensors` (contiguous), one after another."""
        parts = [t for t in tensors if t.numel()]
        with self._registered(parts):
            sizes = [t.nbytes for t in parts]
            [rc] = self.store.batch_put_from_multi_buffers([key], [[t.data_ptr() for t in parts]], [sizes], self.pinned)
        if rc != 0:
            refused = f"the Mooncake store at {self.address.master} refused {sum(sizes)} bytes under {key}"
            raise EngineError(f"{refused} (error {rc}{': no room' if rc == -200 else ''})")

    def get(self, keys: Sequence[str], tensors: Sequence[Sequence[torch.Tensor]]) -> None:
        """Read the object under each key into its tensors (contiguous, sized as the object's parts)."""
        parts = [[t for t in ts if t.numel()] for ts in tensors]
        sizes = [[t.nbytes for t in ts] for ts in parts]
        pointers = [[t.data_ptr() for t in ts] for ts in parts]
        with self._registered([t for ts in parts for t in ts]):
            for _ in range(2):  # a lease that ran out mid-read: the bytes arrived, the check after them failed
                rcs = self.store.batch_get_into_multi_buffers(list(keys), pointers, sizes)
                if LEASE_EXPIRED not in rcs:
                    break
        for key, rc, size in zip(keys, rcs, sizes, strict=True):
            if rc != sum(size):
                got = f"reading {key} from the Mooncake store at {self.address.master} gave {rc}"
                raise EngineError(f"{got} (expected its {sum(size)} bytes)")

    def remove(self, keys: Sequence[str]) -> None:
        """Free `keys` (a key already gone is no error)."""
        if keys:
            for key, rc in zip(keys, self.store.batch_remove(list(keys), True), strict=True):
                if rc not in (0, OBJECT_NOT_FOUND):
                    raise EngineError(f"the Mooncake store at {self.address.master} did not remove {key} (error {rc})")

    def exists(self, key: str) -> bool:
        return self.store.is_exist(key) == 1

    def close(self) -> None:
        self.store.close()


# ---------------------------------------------------------------------------- the two transports


@dataclass(frozen=True)
class FeatureLayout:
    """The features of one request's rows in a `mooncake` object: each row's aux, then its final state, in `dtype`."""

    lengths: tuple[int, ...]  # T of each row, in the request's order
    aux_size: int  # n * Ht
    hidden_size: int
    dtype: torch.dtype

    def empty(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(aux [T, n*Ht], final [T, Ht]) of each row, each tensor in its own storage, to read into."""
        aux, final, dtype = self.aux_size, self.hidden_size, self.dtype
        return [(torch.empty(T, aux, dtype=dtype), torch.empty(T, final, dtype=dtype)) for T in self.lengths]


class ObjectStoreTransport:
    """transport=ray: the features are Ray objects; the pool hands out their references."""

    holds_until_consumed = False  # the pool's budget counts a micro-batch until its last rank has taken it

    def send(self, key: str, features: list) -> list:
        """In the worker: what its computation returns beside its record (Ray stores it, the ranks get its ref)."""
        return features

    def receive(self, handles: list, layouts: list[FeatureLayout], get) -> list:
        """In a rank: the features of each handle's request; `get` reads Ray objects (`eagle31.engine.features`)."""
        return get(handles)

    def consumed(self, pool, handles: list) -> None:
        """In a rank that holds the features of `handles` (Ray frees an object with its last reference)."""

    def free(self, keys: list[str]) -> None:
        """In the pool: the features stored under `keys` are not needed (none are, here)."""

    def open_pool(self) -> None:
        """In the pool's process, before any worker computes."""

    def open(self) -> None:
        """In a worker or a rank, before it computes or trains."""

    def close(self) -> None:
        """In any process, at its end."""


class MooncakeTransport:
    """transport=mooncake: this object travels to the pool, workers and ranks; each opens its own client when used."""

    holds_until_consumed = True  # the pool's budget counts a micro-batch until its keys are removed

    def __init__(self, address: MooncakeAddress, segment_bytes: int):
        self.address, self.segment_bytes = address, int(segment_bytes)
        self.client: MooncakeClient | None = None

    def __getstate__(self) -> dict:
        return {"address": self.address, "segment_bytes": self.segment_bytes, "client": None}

    def _client(self, segment_bytes: int = 0) -> MooncakeClient:
        if self.client is None:
            import ray

            host = ray.util.get_node_ip_address()  # as the other nodes know it
            self.client = MooncakeClient(self.address, host, segment_bytes)
        return self.client

    def open_pool(self) -> None:
        self._client(self.segment_bytes)

    def open(self) -> None:
        """In a worker or a rank: join the store now (a store it cannot join stops it here, not mid-run)."""
        self._client()

    def send(self, key: str, features: list) -> None:
        """The ranks get the key."""
        self._client().put(key, [t.contiguous() for pair in features for t in pair])

    def receive(self, handles: list, layouts: list[FeatureLayout], get) -> list:
        features = [layout.empty() for layout in layouts]
        self._client().get(handles, [[t for pair in f for t in pair] for f in features])
        return features

    def consumed(self, pool, handles: list) -> None:
        pool.consumed.remote(handles)

    def free(self, keys: list[str]) -> None:
        self._client().remove(keys)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None


FeatureTransport = ObjectStoreTransport | MooncakeTransport  # what `features.engine.transport` names


def segment_bytes(tokens: int, bytes_per_token: int) -> int:
    """The pool's segment for `tokens` of features, in whole MiB, with room to spare (docs/engine.md, Transport)."""
    return (math.ceil(1.25 * tokens * bytes_per_token / (1 << 20)) + 32) << 20
