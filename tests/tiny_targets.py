"""The tiny targets every test builds (random transformers models, no downloads), and what the
feature tests feed them or read from them: prepared splits and vLLM-layout captures."""

from __future__ import annotations

from pathlib import Path

import torch
from datasets import Dataset
from safetensors.torch import save_file

VOCAB = 96  # the feature tests' vocabulary
DRAFTER_VOCAB = 40  # tests.helpers.tiny_config's vocabulary


def tiny_llama(seed: int = 0, dtype=torch.float32, **shape):
    """A random Llama in eval mode; `shape` overrides LlamaConfig fields of the 6-layer default."""
    from transformers import LlamaConfig, LlamaForCausalLM

    values = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    values.update(shape)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**values)).to(dtype).eval()


def drafter_sized_llama(seed: int = 0, dtype=torch.float64):
    """A Llama whose shape matches `tests.helpers.tiny_drafter(vocab_size=DRAFTER_VOCAB)`: 8 layers, hidden 16."""
    return tiny_llama(
        seed,
        dtype,
        vocab_size=DRAFTER_VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=8,
        head_dim=8,
        initializer_range=0.3,  # logits far apart: the argmax is stable under rounding
        attn_implementation="sdpa",
    )


def save_chat_target(path: Path, tokenizer, seed: int = 0, **shape) -> Path:
    """An 8-layer Llama sized to `tokenizer`, saved with it as `from_pretrained` reads a target directory; `shape`
    overrides LlamaConfig fields (`VLLM_CPU_LLAMA`: a shape vLLM's CPU attention takes)."""
    values = dict(intermediate_size=64, num_hidden_layers=8, max_position_embeddings=512)
    model = tiny_llama(seed, vocab_size=len(tokenizer), **{**values, **shape})
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# vLLM's CPU attention takes head_dim 32 at the smallest
VLLM_CPU_LLAMA = dict(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32)


def tiny_deepseek_v3(seed: int = 0):
    """MLA (q/kv low rank, rope + nope heads) and MoE (routed + shared experts) after one dense layer."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return DeepseekV3ForCausalLM(cfg).eval()


def prepared_split(num_samples: int, seed: int = 0, min_len: int = 3, max_len: int = 24) -> Dataset:
    """A split as the prepare step writes it: `input_ids`, `loss_mask` per row."""
    g = torch.Generator().manual_seed(seed)
    rows = {"input_ids": [], "loss_mask": []}
    for _ in range(num_samples):
        n = int(torch.randint(min_len, max_len + 1, (1,), generator=g))
        rows["input_ids"].append(torch.randint(1, VOCAB, (n,), generator=g).tolist())
        rows["loss_mask"].append((torch.rand(n, generator=g) < 0.6).long().tolist())
    return Dataset.from_dict(rows)


def write_vllm_captures(model, data, hs_dir, slots=(1, 3, 4, 6), with_loss_mask=False):
    """hs_{i}.safetensors as vLLM's ExampleHiddenStatesConnector writes them for row i of `data`.

    `slots` are vLLM layer ids: k < L is the input of decoder layer k (= output_hidden_states[k]);
    k = L is the last layer's output before the final norm (vLLM appends `hidden_states + residual`
    before `norm`), taken here at the norm's input.
    """
    L = model.config.num_hidden_layers
    hs_dir.mkdir()
    pre_norm = {}
    handle = model.model.norm.register_forward_pre_hook(lambda m, args: pre_norm.update(h=args[0]))
    for i, row in enumerate(data):
        ids = torch.tensor([row["input_ids"]])
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True)
        states = [out.hidden_states[k] if k < L else pre_norm["h"] for k in slots]
        tensors = {"hidden_states": torch.stack(states, dim=2)[0].contiguous(), "token_ids": ids[0]}
        if with_loss_mask:
            tensors["loss_mask"] = torch.tensor(row["loss_mask"])
        save_file(tensors, str(hs_dir / f"hs_{i}.safetensors"))
    handle.remove()


def thinking_conversation(a: int, b: int) -> list[dict]:
    """Two turns of arithmetic with their reasoning, as a thinking model answers them."""
    s = a + b
    return [
        {"role": "user", "content": f"add {a} and {b}"},
        {"role": "assistant", "reasoning_content": f"{a} plus {b} is {s}", "content": f"The answer is {s}."},
        {"role": "user", "content": "and double it?"},
        {"role": "assistant", "reasoning_content": f"{s} times 2 is {2 * s}", "content": f"It is {2 * s}."},
    ]


def save_thinking_target(path: Path, tokenizer, steps: int = 150, seed: int = 0) -> Path:
    """A small Llama trained on `thinking_conversation`s rendered by the Kimi chat template (reasoning kept):
    its greedy replies think in `<think>...</think>`, then answer and end the turn, as a reasoning model does.
    Head dim 32, the smallest vLLM's CPU attention takes. Seconds on a CPU; the same weights for a seed."""
    model = tiny_llama(
        seed,
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ).train()
    texts = [
        tokenizer.apply_chat_template(
            thinking_conversation(a, b), tokenize=False, thinking=True, preserve_thinking=True
        )
        for a in range(10)
        for b in range(10)
    ]
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, rows))
    ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])  # [100, T]
    labels = torch.where(ids == tokenizer.pad_token_id, -100, ids)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for _ in range(steps):
            loss = model(input_ids=ids, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval().generation_config.do_sample = False
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
