"""Inference workers: what computes the target's features in `features.mode=engine`.

An `InferenceWorker` is built from a `WorkerSpec` inside a Ray actor (`eagle31.engine.pool` wraps
it) and answers two calls: `describe()`, what it computes (checked against the recipe before any
training), and `features(token_rows)`, the aux and final hidden states of each row of token ids,
`[T, n*Ht]` and `[T, Ht]` in the target's dtype, on the CPU, each in a storage of its own (Ray
ships a tensor's whole storage: a view into the padded batch would carry the batch).

`HFInferenceWorker` holds the Hugging Face target and runs `eagle31.data.capture.target_forward`,
the code of `features.mode=online`: given the rows of one length-sorted group it runs exactly the
forward the trainer would have run itself. Another engine (vLLM's, whose `extract_hidden_states`
hands the same tensors out) is one more class with these two methods and a line in `WORKERS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol, Sequence

import torch

from eagle31.data.capture import target_forward
from eagle31.recipe import EngineWorker
from eagle31.target import TargetFeatures, load_target


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker of a run is built from (picklable: it travels to the actors)."""

    target_dir: str
    dtype: str  # target.dtype
    device_map: str | None  # target.device_map: spreads the target over the worker's GPUs
    trust_remote_code: bool
    aux_layer_ids: tuple[int, ...]
    batch_tokens: int  # features.capture_batch_tokens
    threads: int  # torch threads on CPU
    gpus: float  # features.engine.worker_gpus


class WorkerInfo(NamedTuple):
    """What a worker computes, compared with what the recipe asks before training starts."""

    kind: str
    aux_layer_ids: tuple[int, ...]
    hidden_size: int
    dtype: str  # of the features, e.g. "bfloat16"
    device: str


class InferenceWorker(Protocol):
    def __init__(self, spec: WorkerSpec): ...

    def describe(self) -> WorkerInfo: ...

    def features(self, token_rows: Sequence[Sequence[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(aux [T, n*Ht], final [T, Ht]) of each row, in order, on the CPU, each tensor in its own storage."""
        ...


class HFInferenceWorker:
    """The Hugging Face target on the worker's GPUs (or its CPUs), features as `features.mode=online` computes them."""

    kind = "hf"

    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        if spec.gpus > 0:  # Ray gives the actor its GPUs as devices 0..n-1
            self.device = torch.device("cuda", 0)
        else:
            torch.set_num_threads(spec.threads)
            self.device = torch.device("cpu")
        self.model = load_target(
            spec.target_dir, self.device, dtype=spec.dtype, device_map=spec.device_map, trust_remote_code=spec.trust_remote_code
        )

    def describe(self) -> WorkerInfo:
        head = self.model.get_output_embeddings().weight  # [V, Ht]
        return WorkerInfo(self.kind, self.spec.aux_layer_ids, int(head.shape[1]), str(head.dtype).removeprefix("torch."), str(self.device))

    def features(self, token_rows: Sequence[Sequence[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        with TargetFeatures(self.model, self.spec.aux_layer_ids) as feats:
            out = target_forward(feats, token_rows, self.spec.batch_tokens)
        return [(aux.to("cpu", copy=True), final.to("cpu", copy=True)) for aux, final in out]


WORKERS: dict[EngineWorker, type] = {EngineWorker.hf: HFInferenceWorker}
