"""Bytes per second from an inference worker to a trainer: through Ray's object store and through Mooncake (tcp).

    python -m benchmarks.transport                         # 3 Kimi-shaped samples a round, 2 rounds of each
    python -m benchmarks.transport samples=2 tokens=1024 rounds=1 out=/tmp/transport

A sample is what a Kimi K2.6 worker sends for `tokens` tokens: aux [T, 3 x 7168] and final [T, 7168] in bf16,
56 KiB a token (224 MiB for 4,096 tokens). Each transport runs as the engine runs it (`eagle31.engine.transport`),
between processes of this machine on a local Ray cluster this process starts: a producer actor (the inference
worker) holds the tensors and sends them under a key; this process (the trainer) receives them into its own
tensors. With Mooncake an owner actor (the pool) holds the store's segment and removes each key once it is read,
and the master is one this process starts on free ports (stopped at the end, whatever happens). One sample at a
time, sent and received before the next: `send` is the time until the producer's call has returned (Ray: its
result is in the object store; Mooncake: written into the owner's segment), `total` until the trainer holds the
tensors. Bytes per second = a sample's bytes / its `total`; medians over every round's samples after one warm-up
sample per round; the rounds alternate the transports so both meet the machine's other load alike. The first
sample received through each transport is compared with the producer's, bit for bit. Ratio: Mooncake / Ray,
measured in the same run.

Writes `<out>/transport.json` and `.md` (default benchmarks/results/).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path

import torch

from benchmarks.report import write_result_and_table
from eagle31.engine.cluster import NAMESPACE, actor_runtime_env, init_ray
from eagle31.engine.transport import (
    FeatureLayout,
    MooncakeTransport,
    ObjectStoreTransport,
    mooncake_master,
    segment_bytes,
)
from eagle31_cli import parse_key_values, run_cli

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class Settings:
    samples: int = 3  # measured a round, after one warm-up sample
    rounds: int = 2  # of each transport, alternating
    tokens: int = 4096
    aux_layers: int = 3
    hidden: int = 7168
    cpus: int = 2  # of the Ray cluster this process starts
    out: str = str(ROOT / "benchmarks" / "results")


def sample(settings: Settings) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One request's features: one row of `tokens` tokens, (aux [T, n*H], final [T, H]) in bf16, the same each call."""
    g = torch.Generator().manual_seed(0)
    T, H = settings.tokens, settings.hidden
    return [(torch.randn(T, settings.aux_layers * H, generator=g).to(torch.bfloat16),
             torch.randn(T, H, generator=g).to(torch.bfloat16))]  # fmt: skip


class Producer:
    """The inference worker: holds a sample, sends it through `transport` (a Ray actor)."""

    def __init__(self, settings: Settings, transport):
        torch.set_num_threads(1)
        self.features, self.transport = sample(settings), transport
        transport.open()

    def send(self, key: str):
        return self.transport.send(key, self.features)


class Owner:
    """The pool: holds the Mooncake store's segment, removes keys once read (a Ray actor)."""

    def __init__(self, transport):
        self.transport = transport
        transport.open_pool()

    def free(self, keys: list[str]) -> None:
        self.transport.free(keys)


def measure(ray, settings: Settings, transport, producer, owner, expected) -> dict:
    """Warm-up and `samples` timed samples through `transport`; seconds of each sample's send and total."""
    layout = FeatureLayout((settings.tokens,), settings.aux_layers * settings.hidden, settings.hidden, torch.bfloat16)
    sends, totals = [], []
    for i in range(settings.samples + 1):
        key = f"bench-{uuid.uuid4().hex[:8]}"
        start = time.perf_counter()
        sent = producer.send.remote(key)
        ray.wait([sent], fetch_local=False)
        sent_at = time.perf_counter()
        if isinstance(transport, ObjectStoreTransport):
            handles = [sent]
        else:
            ray.get(sent)  # None, or the producer's error
            handles = [key]
        [features] = transport.receive(handles, [layout], ray.get)
        done = time.perf_counter()
        if owner is not None:
            ray.get(owner.free.remote([key]))
        if i == 0:  # the warm-up sample: the bits, not the time
            assert all(torch.equal(a, b) for pair, want in zip(features, expected, strict=True)
                       for a, b in zip(pair, want, strict=True)), "a sample arrived changed"  # fmt: skip
            continue
        sends.append(sent_at - start)
        totals.append(done - start)
        del features
    return {"send_s": sends, "total_s": totals}


def main(argv: list[str]) -> None:
    import ray

    settings = parse_key_values(argv, Settings)
    expected = sample(settings)
    nbytes = sum(t.numel() * t.element_size() for pair in expected for t in pair)
    init_ray(ray, num_cpus=settings.cpus, include_dashboard=False, log_to_driver=False,
             logging_level=logging.ERROR, namespace=NAMESPACE)  # fmt: skip
    options = {"num_cpus": 0, "runtime_env": actor_runtime_env()}
    try:
        with mooncake_master(ray.util.get_node_ip_address(), "tcp") as address:
            carriers = {
                "ray": ObjectStoreTransport(),
                "mooncake": MooncakeTransport(address, segment_bytes(2 * settings.tokens, nbytes // settings.tokens)),
            }
            owner = ray.remote(Owner).options(**options).remote(carriers["mooncake"])
            ray.get(owner.__ray_ready__.remote())  # its segment is in the store before anything is written
            producers = {name: ray.remote(Producer).options(**options).remote(settings, c)
                         for name, c in carriers.items()}  # fmt: skip
            carriers["mooncake"].open()
            runs: dict[str, list[dict]] = {name: [] for name in carriers}
            for _ in range(settings.rounds):
                for name, carrier in carriers.items():
                    keeper = owner if name == "mooncake" else None
                    runs[name].append(measure(ray, settings, carrier, producers[name], keeper, expected))
                    print(f"{name}: {runs[name][-1]}", flush=True)
            carriers["mooncake"].close()
    finally:
        ray.shutdown()
    result = summarise(settings, nbytes, runs)
    write_result_and_table(result, Path(settings.out) / "transport.json", table(result))


def summarise(settings: Settings, nbytes: int, runs: dict[str, list[dict]]) -> dict:
    per = {}
    for name, rounds in runs.items():
        totals = [t for r in rounds for t in r["total_s"]]
        sends = [t for r in rounds for t in r["send_s"]]
        per[name] = {"total_s": totals, "send_s": sends, "median_total_s": statistics.median(totals),
                     "median_send_s": statistics.median(sends),
                     "bytes_per_s": nbytes / statistics.median(totals)}  # fmt: skip
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "settings": {k: v for k, v in dataclasses.asdict(settings).items() if k != "out"},  # no machine path
        "sample_bytes": nbytes,
        "transports": per,
        "mooncake_over_ray": per["mooncake"]["bytes_per_s"] / per["ray"]["bytes_per_s"],
    }


def table(result: dict) -> str:
    s, per = result["settings"], result["transports"]
    lines = [
        f"# Transport: one worker to one trainer, one machine ({result['date']}, {result['machine']})",
        "",
        f"A sample: {s['tokens']} tokens x ({s['aux_layers']} aux + final) x {s['hidden']} bf16 = "
        f"{result['sample_bytes'] / 2**20:.0f} MiB; {s['rounds']} rounds x {s['samples']} samples each, medians.",
        "",
        "| transport | send (median) | send to received (median) | bytes/s | vs Ray |",
        "|---|---|---|---|---|",
    ]
    for name, p in per.items():
        ratio = p["bytes_per_s"] / per["ray"]["bytes_per_s"]
        lines.append(f"| {name} | {p['median_send_s']:.3f} s | {p['median_total_s']:.3f} s | "
                     f"{p['bytes_per_s'] / 1e9:.2f} GB/s | {ratio:.2f}x |")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(run_cli(lambda: main(sys.argv[1:])))
