"""Run by SGLang 0.5.23's own interpreter (tests/peers.py), never imported by the project: SGLang's code applied to
eagle31's exports of the EAGLE-3 HF layout. One call reads a JSON request (argv[1]) and prints one JSON answer.

For every export directory, what `python -m sglang.launch_server --speculative-algorithm EAGLE3
--speculative-draft-model-path DIR` does with it, in SGLang's own code, on one CPU rank:

* the target layers it captures: `model_runner_components/spec_aux_hidden_state.py::
  resolve_spec_aux_hidden_state_config` on the published server args, then the Llama and the DeepSeek target's
  `set_eagle3_layers_to_capture` (`models/llama.py`, `models/deepseek_v2.py`) on a stand-in of the target model
  that holds only its layer count;
* the draft's config: `configs/model_config.py::ModelConfig(DIR, is_draft_model=True)`;
* the draft model: `model_loader/loader.py::_initialize_model` (the class `ModelRegistry` maps the architecture to),
  every parameter then set to NaN, and `DefaultModelLoader.load_weights_and_postprocess` over the export's
  safetensors (the model's own `load_weights`): which parameters stay NaN (never loaded), and where each exported
  tensor landed (the rows of the parameter that hold it); the switches it built, its attention's softmax scale and
  window, and the rows of its rope's cos/sin table at the asked positions;
* the draft's first two steps on given target hidden states and tokens, each through the model's own `forward`
  (`models/llama_eagle3.py::LlamaForCausalLMEagle3`, `models/kimi_k25_eagle3.py::Eagle3DeepseekV2ForCausalLM`:
  the drafter, then its `LogitsProcessor` over its `lm_head`) as `speculative/eagle_worker_v2.py` runs them with
  `CaptureHiddenMode.LAST`: step 0, the draft extend over a prompt (`_draft_extend_for_prefill`: an `EXTEND`
  batch), then step 1, a draft decode (`DECODE`) at the next position fed the hidden state step 0 captured. One
  request, the embedding set to the target's as `set_embed` shares it; forward hooks see the fused feature (the
  output of `fc`) and the drafter's two outputs (the state `lm_head` reads, the feature the next step reads); for
  the MLA drafter, which of `DeepseekV2AttentionMLA`'s forward methods each step dispatched to.
* `python -m sglang.launch_server ARGV` for each given ARGV, as far as `server_args.py::prepare_server_args`.

The attention backend is SGLang's own `torch_native` (`--attention-backend torch_native`: `TorchNativeAttnBackend`
on a real `ReqToTokenPool` and `MHATokenToKVPool` or `MLATokenToKVPool`), under which `DeepseekV2AttentionMLA`
takes its MHA path for a prompt (`forward_mha.py`) and its absorbed MLA path for a decode (`forward_mla.py`: q
through `w_kc`, the output through `w_vc`, both split from `kv_b_proj` by `post_load_weights`), as the FlashInfer,
FA3 and Triton backends dispatch them.

Emulated, because it needs a GPU or a kernel that is not on a CPU:
* `vllm._custom_ops.rotary_embedding`, which `layers/rotary_embedding/base.py::RotaryEmbedding.__init__` imports as
  its fused-kernel fallback on a platform that is neither CUDA nor SGLang's CPU engine: a stand-in that fails if it
  is called (the forward runs `forward_native`, SGLang's torch implementation);
* the MLA prompt's attention kernel: the MHA path hands the backend decompressed q, k, v with
  `save_kv_cache=False` (the latent goes into the `MLATokenToKVPool` before), which FlashInfer's, FA3's and
  Triton's ragged prefill attend causally at `layer.scaling`; `TorchNativeAttnBackend.forward_extend` would read
  k and v from the pool, which holds the latent, so that one call is
  `torch.nn.functional.scaled_dot_product_attention` over the given q, k, v (`_MHAPrefillKernel`).

The server args are published as SGLang's own layer tests publish them (`sglang/test/layer_ut_utils.py::
init_single_process_dist`, `sglang/test/test_utils.py::publish_build_topology`: world size 1, gloo), with
`device="cpu"`, under which `DeepseekV2AttentionMLA` builds its rope through `get_rope_cpu`.
"""

import json
import logging
import os
import socket
import sys
import traceback
import types

# ------------------------------------------------------------------ the emulated kernel import (module docstring)


def _rotary_kernel_stand_in(*args, **kwargs):
    raise RuntimeError("the stand-in of vllm._custom_ops.rotary_embedding was called: the forward left forward_native")


_custom_ops = types.ModuleType("vllm._custom_ops")
_custom_ops.rotary_embedding = _rotary_kernel_stand_in
_vllm = types.ModuleType("vllm")
_vllm._custom_ops = _custom_ops
sys.modules.setdefault("vllm", _vllm)
sys.modules.setdefault("vllm._custom_ops", _custom_ops)

import sglang  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from sglang.srt.configs.load_config import LoadConfig  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.distributed import parallel_state  # noqa: E402
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode  # noqa: E402
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context  # noqa: E402
from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (  # noqa: E402
    resolve_spec_aux_hidden_state_config,
)
from sglang.srt.model_loader import get_model_loader  # noqa: E402
from sglang.srt.model_loader.loader import _initialize_model  # noqa: E402
from sglang.srt.model_loader.utils import set_default_torch_dtype  # noqa: E402
from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM  # noqa: E402
from sglang.srt.models.llama import LlamaForCausalLM  # noqa: E402
from sglang.srt.runtime_context import SpawnRanks, get_parallel, get_spec, publish, reset_context  # noqa: E402
from sglang.srt.server_args import ServerArgs, prepare_server_args  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

CPU = torch.device("cpu")
CONFIG_FIELDS = (
    "model_type",
    "architectures",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "draft_vocab_size",
    "target_hidden_size",
    "num_aux_hidden_states",
    "eagle_config",
    "fc_norm",
    "norm_output",
    "norm_before_fc",
    "norm_before_residual",
    "tie_word_embeddings",
    "rms_norm_eps",
    "max_position_embeddings",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "rope_parameters",
    "sliding_window",
)


def plain(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_args(**fields) -> ServerArgs:
    return ServerArgs(
        model_path="dummy", device="cpu", attention_backend="torch_native", tp_size=1, ep_size=1, pp_size=1, **fields
    )


def init_one_rank() -> None:
    """World size 1 over gloo with the server args published, as SGLang's layer tests do (module docstring)."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(free_port())
    parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
    reset_context()
    publish(server_args(), role="test", ranks=SpawnRanks(world_rank=0))
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    parallel_state.initialize_model_parallel(backend="gloo")


def captured_layers(path: str, target_layers: int) -> dict:
    """The target layers SGLang captures for the draft at `path` (module docstring)."""
    args = server_args(speculative_algorithm="EAGLE3", speculative_draft_model_path=path)
    with get_spec().override(speculative_draft_model_path=path):
        resolved = resolve_spec_aux_hidden_state_config(
            server_args=args,
            model_config=None,
            spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE3"),
            is_draft_worker=False,
        )
    ids = resolved.eagle_aux_hidden_state_layer_ids
    captured = {}
    for target in (LlamaForCausalLM, DeepseekV2ForCausalLM):
        stand_in = types.SimpleNamespace(
            pp_group=types.SimpleNamespace(is_last_rank=True),
            config=types.SimpleNamespace(num_hidden_layers=target_layers),
            model=types.SimpleNamespace(),
        )
        target.set_eagle3_layers_to_capture(stand_in, ids)
        captured[target.__name__] = list(stand_in.model.layers_to_capture)
    return {"layer_ids": plain(ids), "use_aux": resolved.eagle_use_aux_hidden_state, "captured": captured}


def placements(model: torch.nn.Module, tensors: dict) -> dict:
    """For each exported tensor, the parameter rows that hold it after loading: [name, first row, end row]."""
    params = dict(model.named_parameters())
    found = {}
    for key, tensor in tensors.items():
        found[key] = []
        for name, p in params.items():
            if p.dim() != tensor.dim() or p.shape[1:] != tensor.shape[1:] or p.shape[0] < tensor.shape[0]:
                continue
            rows = tensor.shape[0]
            for start in range(p.shape[0] - rows + 1):
                if torch.equal(p.data[start : start + rows], tensor.to(p.dtype)):
                    found[key].append([name, start, start + rows])
    return found


class _MHAPrefillKernel(TorchNativeAttnBackend):
    """The MLA drafter's MHA prefill kernel, emulated (module docstring); the rest is SGLang's torch backend."""

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if save_kv_cache:
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        q = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim).transpose(0, 1)  # [nh, T, d]
        k = k.view(-1, layer.tp_k_head_num, layer.qk_head_dim).transpose(0, 1)
        v = v.view(-1, layer.tp_v_head_num, layer.v_head_dim).transpose(0, 1)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=layer.scaling)
        return o.transpose(0, 1).reshape(-1, layer.tp_q_head_num * layer.v_head_dim)


def kv_pool(cfg, mla: bool, size: int):
    common = dict(size=size, page_size=1, dtype=torch.float32, layer_num=1, device="cpu", enable_memory_saver=False)
    if mla:
        return MLATokenToKVPool(kv_lora_rank=cfg.kv_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim, **common)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    # the drafter's one layer has id num_hidden_layers - 1 = 0 in its own pool
    return MHATokenToKVPool(head_num=cfg.num_key_value_heads, head_dim=head_dim, start_layer=0, end_layer=1, **common)


def batch(mode: ForwardMode, ids: torch.Tensor, positions: torch.Tensor, seq_len: int, hidden: torch.Tensor):
    """A `ForwardBatch` of one request (pool row 1) whose cache slots are 1..seq_len."""
    n = ids.shape[0]
    fb = ForwardBatch(
        forward_mode=mode,
        batch_size=1,
        input_ids=ids,
        req_pool_indices=torch.tensor([1]),
        seq_lens=torch.tensor([seq_len]),
        out_cache_loc=torch.arange(seq_len - n + 1, seq_len + 1),
        seq_lens_sum=seq_len,
        positions=positions,
        seq_lens_cpu=torch.tensor([seq_len]),
    )
    if mode.is_extend():
        fb.extend_prefix_lens = torch.tensor([seq_len - n])
        fb.extend_seq_lens = torch.tensor([n])
        fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu = [seq_len - n], [n]
    fb.spec_info = types.SimpleNamespace(hidden_states=hidden)  # what the draft model reads of EagleDraftInput
    fb.capture_hidden_mode = CaptureHiddenMode.LAST  # as the EAGLE worker's draft forwards capture it
    return fb


def recording(dispatch, seen: list):
    """`dispatch_attn_forward_method` that also appends the method's name and its backend's to `seen`."""

    def dispatched(forward_batch):
        method = dispatch(forward_batch)
        seen.append([method.name, dispatch.__self__.current_attention_backend])
        return method

    return dispatched


def run_steps(model, cfg, mla: bool, inputs: dict) -> dict:
    """Step 0 (the draft extend over the prompt) and step 1 (a draft decode at its end, fed step 0's captured
    hidden state), each through the model's own `forward` as `draft_runner.forward` calls it."""
    aux, tokens, embed = inputs["aux"], inputs["tokens"], inputs["embed"]  # [T, n*Ht], [T], [V, H]
    T = tokens.shape[0]
    model.model.embed_tokens.weight.data[: embed.shape[0]] = embed  # set_embed: the target's embedding
    req = ReqToTokenPool(size=2, max_context_len=T + 2, device="cpu", enable_memory_saver=False)
    req.req_to_token[1, : T + 1] = torch.arange(1, T + 2)
    runner = types.SimpleNamespace(device="cpu", req_to_token_pool=req, token_to_kv_pool=kv_pool(cfg, mla, T + 2))
    backend = (_MHAPrefillKernel if mla else TorchNativeAttnBackend)(runner)
    fused, inner, methods = [], [], []
    if mla:  # which of DeepseekV2AttentionMLA's forward methods each step takes (MHA prefill, absorbed MLA decode)
        attn = model.model.midlayer.self_attn
        attn.dispatch_attn_forward_method = recording(attn.dispatch_attn_forward_method, methods)
    hooks = [
        model.model.fc.register_forward_hook(lambda m, i, o: fused.append(o[0] if isinstance(o, tuple) else o)),
        model.model.register_forward_hook(lambda m, i, o: inner.append(o)),
    ]
    out = {}
    with torch.no_grad(), forward_context(ForwardContext(attn_backend=backend)):
        hidden = aux
        for step, (mode, ids, positions, seq_len) in enumerate(
            [
                (ForwardMode.EXTEND, tokens, torch.arange(T), T),
                (ForwardMode.DECODE, inputs["next_token"], torch.tensor([T]), T + 1),
            ]
        ):
            fb = batch(mode, ids, positions, seq_len, hidden)
            backend.init_forward_metadata(fb)
            logits = model(ids, fb.positions, fb)
            state, (feature,) = inner[-1]
            hidden = logits.hidden_states  # [1, H] the last position's feature: the next step's input
            out[f"step{step}"] = {
                "state": plain(state),
                "feature": plain(feature),
                "logits": plain(logits.next_token_logits),  # [1, draft V] at the last position
                "captured": plain(hidden),
            }
        out["step0"]["fused"] = plain(fused[0])
        out["fc_calls"] = len(fused)
        out["mla_methods"] = methods
    for hook in hooks:
        hook.remove()
    return out


def read_export(path: str, inputs_path: str | None, window: int | None, positions: list[int]) -> dict:
    meta = json.load(open(f"{path}/config.json"))
    target_layers = (meta.get("eagle31") or {}).get("target_num_layers") or 32
    answer = {"capture": captured_layers(path, target_layers)}
    model_config = ModelConfig(model_path=path, is_draft_model=True, speculative_algorithm="EAGLE3", dtype="float32")
    cfg = model_config.hf_config
    answer["config"] = {
        "class": type(cfg).__name__,
        "fields": {k: plain(getattr(cfg, k)) for k in CONFIG_FIELDS if hasattr(cfg, k)},
        "attention_arch": model_config.attention_arch.name,
        "dtype": str(model_config.dtype),
    }
    load_config = LoadConfig()
    loader = get_model_loader(load_config, model_config)
    handler = _Collect(logging.WARNING)
    with set_default_torch_dtype(model_config.dtype):
        with CPU, get_spec().override(speculative_draft_window_size=window):  # --speculative-draft-window-size
            model = _initialize_model(model_config, load_config, None)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
        logging.getLogger("sglang").addHandler(handler)
        try:
            loader.load_weights_and_postprocess(model, loader._get_all_weights(model_config, model), CPU)
        finally:
            logging.getLogger("sglang").removeHandler(handler)
    inner = model.model
    tensors = load_file(f"{path}/model.safetensors")
    attn = inner.layers[0].self_attn if hasattr(inner, "layers") else inner.midlayer.self_attn
    mla = hasattr(attn, "kv_lora_rank")
    answer["model"] = {
        "class": type(model).__name__,
        "params": {n: list(p.shape) for n, p in model.named_parameters()},
        "unloaded": [n for n, p in model.named_parameters() if bool(p.isnan().any())],
        "placed": placements(model, {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}),
        "loader_warnings": handler.messages,
        "hot_token_id": plain(model.hot_token_id),
        "load_lm_head_from_target": model.load_lm_head_from_target,
        "fc_norm": None if inner.fc_norm is None else len(inner.fc_norm),
        "input_norm": getattr(inner, "input_norm", None) is not None,
        "norm_output": inner.norm_output,
        "num_aux_hidden_states": inner.num_aux_hidden_states,
        "attention_scaling": attn.scaling if mla else attn.attn.scaling,
        "sliding_window_size": None if mla else attn.attn.sliding_window_size,
    }
    rope = attn.rotary_emb
    rows = [p for p in positions if p < rope.cos_sin_cache.shape[0]]
    answer["model"]["rope"] = {
        "class": type(rope).__name__,
        "is_neox_style": rope.is_neox_style,
        "table_len": rope.cos_sin_cache.shape[0],
        "positions": rows,
        "cos_sin_cache": plain(rope.cos_sin_cache[rows].to(torch.float64)),
    }
    if inputs_path:
        answer["forward"] = run_steps(model, cfg, mla, load_file(inputs_path))
    return answer


class _Collect(logging.Handler):
    """Keeps the messages logged while the weights load (the MLA loader warns of each weight it skips)."""

    def __init__(self, level: int):
        super().__init__(level)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def parse_command(argv: list[str]) -> dict:
    """`python -m sglang.launch_server ARGV` as `launch_server.py` parses it (`prepare_server_args`, before the
    server resolves anything): its serving and speculative fields, or the parser's error."""
    try:
        args = prepare_server_args(argv)
    except SystemExit:
        return {"error": traceback.format_exc()[-1000:]}
    names = ("model_path", "trust_remote_code", "tp_size")
    return {n: plain(getattr(args, n)) for n in dir(args) if n in names or n.startswith("speculative_")}


def main() -> None:
    request = json.loads(open(sys.argv[1]).read())
    init_one_rank()
    exports = {}
    for item in request["exports"]:
        try:
            exports[item["path"]] = read_export(
                item["path"], item.get("inputs"), item.get("window"), request.get("positions", [0, 1])
            )
        except Exception:
            exports[item["path"]] = {"crash": traceback.format_exc()[-3000:]}
    commands = [parse_command(argv) for argv in request.get("commands", [])]
    print(json.dumps({"version": sglang.__version__, "exports": exports, "commands": commands}))


main()
