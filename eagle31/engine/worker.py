"""Inference workers: the HF target or a vLLM engine, which compute the target's features and say what they compute."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple, Protocol

import torch

from eagle31.data.capture import target_forward
from eagle31.target import TargetFeatures, load_target, target_fingerprints


class EngineWorker(StrEnum):
    """What computes the features in `features.mode=engine` and in data_prep/capture.py."""

    hf = "hf"  # the Hugging Face target, as online features compute them
    vllm = "vllm"  # a vLLM engine (>= 0.22, installed beside eagle31): extract_hidden_states


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
    max_len: int = 2048  # data.max_len: the longest row the worker is sent
    vllm_args: dict = field(default_factory=dict)  # features.engine.vllm_args

    @classmethod
    def from_recipe(cls, cfg, target_dir, aux_layer_ids: Sequence[int]) -> WorkerSpec:
        e = cfg.features.engine
        return cls(
            target_dir=str(target_dir),
            dtype=str(cfg.target.dtype),
            device_map=cfg.target.device_map,
            trust_remote_code=cfg.target.trust_remote_code,
            aux_layer_ids=tuple(int(i) for i in aux_layer_ids),
            batch_tokens=cfg.features.capture_batch_tokens,
            threads=max(1, int(e.worker_cpus)),
            gpus=e.worker_gpus,
            max_len=cfg.data.max_len,
            vllm_args=dict(e.vllm_args),
        )


class WorkerInfo(NamedTuple):
    """What a worker computes, compared with what the recipe asks before training starts."""

    kind: str
    aux_layer_ids: tuple[int, ...]
    hidden_size: int
    dtype: str  # of the features, e.g. "bfloat16"
    device: str
    target_fingerprint: str  # eagle31.target.target_fingerprint of spec.target_dir on the worker's node
    tokenizer_fingerprint: str  # eagle31.target.tokenizer_fingerprint, the same


# What a differing fingerprint means, in the line that refuses the worker.
FINGERPRINTS = {"target_fingerprint": "weights or config differ", "tokenizer_fingerprint": "tokenizer differs"}


def expected_info(target_dir, aux_layer_ids: Sequence[int], hidden_size: int, dtype: str) -> dict:
    """What every worker's `describe()` must say for a recipe, the fingerprints of `target_dir` as this node sees it."""
    ids, dtype = tuple(int(i) for i in aux_layer_ids), str(dtype)
    return {"aux_layer_ids": ids, "hidden_size": int(hidden_size), "dtype": dtype, **target_fingerprints(target_dir)}


def worker_mismatch(info: WorkerInfo, expected: dict, target_dir) -> str | None:
    """What in `info` differs from `expected` (`expected_info` or some of its keys), to end a line naming the worker."""
    differ = []
    for name, want in expected.items():
        got = getattr(info, name)
        if got != want and name in FINGERPRINTS:
            target = f"a target whose {FINGERPRINTS[name]} from the recipe's target {target_dir}"
            differ.append(f"runs {target} (fingerprint {got[:12]}..., expected {want[:12]}...)")
        elif got != want:
            differ.append(f"computes {name} {got}, the recipe asks for {want}")
    return "; ".join(differ) or None


class InferenceWorker(Protocol):
    def __init__(self, spec: WorkerSpec): ...

    def describe(self) -> WorkerInfo: ...

    def features(self, token_rows: Sequence[Sequence[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(aux [T, n*Ht], final [T, Ht]) of each row, in order, on the CPU, in the target's dtype, each tensor in its
        own storage (Ray ships a tensor's whole storage: a view into the padded batch would carry the batch)."""
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
            spec.target_dir,
            self.device,
            dtype=spec.dtype,
            device_map=spec.device_map,
            trust_remote_code=spec.trust_remote_code,
        )
        self.hooks = TargetFeatures(self.model, spec.aux_layer_ids)  # what `features` runs with

    def describe(self) -> WorkerInfo:
        """The aux ids the installed hooks keep (a forward shows which states), the lm_head's width and dtype."""
        head = self.model.get_output_embeddings().weight  # [V, Ht]
        width, dtype = int(head.shape[1]), str(head.dtype).removeprefix("torch.")
        fingerprints = target_fingerprints(self.spec.target_dir)
        return WorkerInfo(self.kind, self.hooks.resolved_layer_ids(), width, dtype, str(self.device), **fingerprints)

    def features(self, token_rows: Sequence[Sequence[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        with self.hooks as feats:
            out = target_forward(feats, token_rows, self.spec.batch_tokens)
        return [(aux.to("cpu", copy=True), final.to("cpu", copy=True)) for aux, final in out]


class VLLMInferenceWorker:
    """A vLLM engine on the target (`eagle31.engine.vllm_engine`), tensor parallel over the worker's GPUs or on CPUs."""

    kind = "vllm"

    def __init__(self, spec: WorkerSpec):
        from eagle31.engine.vllm_engine import VLLMFeatures

        self.spec = spec
        if spec.gpus <= 0:
            torch.set_num_threads(spec.threads)
        self.engine = VLLMFeatures(
            spec.target_dir,
            spec.aux_layer_ids,
            dtype=spec.dtype,
            max_prompt_len=spec.max_len,
            trust_remote_code=spec.trust_remote_code,
            tensor_parallel_size=max(1, int(spec.gpus)),
            engine_args=spec.vllm_args,
        )

    def describe(self) -> WorkerInfo:
        """What the engine computes, read off a two-token row: the layers vLLM resolved, the states' width and dtype."""
        answer = self.engine.answer([[1, 2]])[0]
        ids = answer.layer_ids  # the aux ids, then the last layer (`final` is its output, normed here)
        aux_ids = ids[:-1] if ids[-1:] == (self.engine.num_layers,) else ids
        width, dtype = int(answer.states.shape[2]), str(answer.states.dtype).removeprefix("torch.")
        device, fingerprints = "cuda" if self.spec.gpus > 0 else "cpu", target_fingerprints(self.spec.target_dir)
        return WorkerInfo(self.kind, aux_ids, width, dtype, device, **fingerprints)

    def features(self, token_rows: Sequence[Sequence[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.engine.features(token_rows)  # fresh CPU tensors, one storage each


WORKERS: dict[EngineWorker, type] = {EngineWorker.hf: HFInferenceWorker, EngineWorker.vllm: VLLMInferenceWorker}
