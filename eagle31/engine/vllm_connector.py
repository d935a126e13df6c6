"""The KV connector that writes `extract_hidden_states`' captures to files; loaded by vLLM only (docs/engine.md)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

from eagle31.engine.vllm_engine import LAYER_IDS_KEY

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


@dataclass
class FinishedRequest:
    req_id: str
    path: str
    num_tokens: int
    block_ids: list[int]


@dataclass
class HiddenStatesMetadata(KVConnectorMetadata):
    finished: list[FinishedRequest] = field(default_factory=list)


def hidden_states_group(kv_cache_config: KVCacheConfig | None, block_size: int) -> tuple[int, int]:
    """The KV cache group of the cache-only layer and its block size: its own group beside the target's attention, or
    the only group (vLLM's CPU build puts every layer in one); without a config, group 0 of `block_size`."""
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    if kv_cache_config is None:
        return 0, block_size
    all_groups = kv_cache_config.kv_cache_groups
    groups = [g for g, group in enumerate(all_groups) if isinstance(group.kv_cache_spec, HiddenStateCacheSpec)]
    if not groups and len(all_groups) == 1:
        groups = [0]
    if len(groups) != 1:
        raise ValueError(f"expected one hidden-states KV cache group, found {len(groups)}")
    return groups[0], all_groups[groups[0]].kv_cache_spec.block_size


class HiddenStatesToFiles(KVConnectorBase_V1, SupportsHMA):
    """Writes each finished request's captured hidden states to `<hidden_states_dir>/<request id>.safetensors`."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if vllm_config.speculative_config is None or vllm_config.speculative_config.method != "extract_hidden_states":
            raise ValueError("HiddenStatesToFiles needs speculative_config.method='extract_hidden_states'")
        self.directory = self._kv_transfer_config.get_from_extra_config("hidden_states_dir", None)
        if not self.directory:
            raise ValueError("HiddenStatesToFiles needs kv_connector_extra_config.hidden_states_dir")
        self.group, self.block_size = hidden_states_group(kv_cache_config, vllm_config.cache_config.block_size)
        draft = vllm_config.speculative_config.draft_model_config
        ids = getattr(draft.hf_config, "eagle_aux_hidden_state_layer_ids", None) if draft is not None else None
        self.layer_ids = json.dumps([int(i) for i in ids or []])  # what extract_hidden_states keeps, as resolved here
        self._finished: list[FinishedRequest] = []  # scheduler side, until the next step's metadata
        self._cache: torch.Tensor | None = None  # worker side: [num_blocks, n, block_size, Ht]
        self._writes = True

    def get_finished_count(self) -> int:
        return 1  # only tensor-parallel rank 0 reports a request as sent

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        self._writes = get_tensor_model_parallel_rank() == 0
        names = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if len(names) != 1:
            raise ValueError(f"expected one cache-only attention layer, found {names}")
        self._cache = kv_caches[names[0]]
        if self._cache.shape[2] != self.block_size:
            raise ValueError(
                f"hidden-states cache block size {self._cache.shape[2]} is not the group's {self.block_size}"
            )

    def start_load_kv(self, *args, **kwargs: Any) -> None:
        pass  # nothing is ever loaded

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        pass  # the cache-only layer has already stored the states

    def wait_for_save(self) -> None:
        pass

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if not self.has_connector_metadata():
            return None, None
        finished = getattr(self._get_connector_metadata(), "finished", [])
        if self._writes:
            for request in finished:
                self._write(request)
        return {request.req_id for request in finished} or None, None

    def _write(self, request: FinishedRequest) -> None:
        assert self._cache is not None
        blocks = torch.tensor(request.block_ids, dtype=torch.long, device=self._cache.device)
        states = self._cache[blocks].transpose(1, 2).flatten(0, 1)[: request.num_tokens].to("cpu")  # [T, n, Ht]
        tmp = f"{request.path}.tmp"
        save_file({"hidden_states": states.contiguous()}, tmp, metadata={LAYER_IDS_KEY: self.layer_ids})
        os.replace(tmp, request.path)

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = HiddenStatesMetadata(finished=self._finished)
        self._finished = []
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks until the worker has written them; the reply names the file."""
        if request.prompt_token_ids is None or not block_ids:
            return False, None
        path = os.path.join(self.directory, f"{request.request_id}.safetensors")
        self._finished.append(FinishedRequest(request.request_id, path, len(request.prompt_token_ids), list(block_ids)))
        return True, {"hidden_states_path": path}

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if not 0 <= self.group < len(block_ids):
            return False, None
        return self.request_finished(request, block_ids[self.group])
