"""The local Kimi tokenizer: special tokens, chat format, save/load offline."""

import json

import pytest
from transformers import AutoTokenizer

from eagle31.targets.kimi_tokenizer import KIMI_SPECIAL_TOKENS, build_kimi_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_kimi_tokenizer()


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "greet them"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "add"},
]

EXPECTED = (
    "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
    "<|im_user|>user<|im_middle|>Hi<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><think></think>Hello!<|im_end|>"
    "<|im_user|>user<|im_middle|>2+2?<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><think>add</think>4<|im_end|>"
)


def test_special_tokens_are_single_ids(tok):
    ids = [tok.convert_tokens_to_ids(t) for t in KIMI_SPECIAL_TOKENS]
    # distinct ids after the BPE vocabulary, as Kimi's are
    assert sorted(ids) == list(range(len(tok) - len(KIMI_SPECIAL_TOKENS), len(tok)))
    for t, i in zip(KIMI_SPECIAL_TOKENS, ids):
        assert tok.encode(f"a{t}b", add_special_tokens=False)[1:-1] == [i], t
    assert tok.eos_token == "<|im_end|>" and tok.bos_token == "[BOS]" and tok.pad_token == "[PAD]"


def test_text_round_trips_and_no_bos_is_added(tok):
    text = "def f(x):\n    return x * 2  # ünïcode ✓"
    ids = tok.encode(text)
    assert ids[0] != tok.bos_token_id
    assert tok.decode(ids) == text


def test_multi_turn_render_keeps_only_the_last_reasoning(tok):
    assert tok.apply_chat_template(CONVERSATION, tokenize=False) == EXPECTED


def test_generation_prompt_is_a_prefix_of_the_full_render(tok):
    prompt = tok.apply_chat_template(CONVERSATION[:-1], tokenize=False, add_generation_prompt=True)
    assert prompt == EXPECTED[: -len("add</think>4<|im_end|>")]
    assert prompt.endswith("<|im_assistant|>assistant<|im_middle|><think>")


def test_default_system_prompt_and_instant_mode(tok):
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True, thinking=False
    )
    assert text == (
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
        "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>"
    )
    instant = tok.apply_chat_template(CONVERSATION, tokenize=False, thinking=False)
    assert instant == EXPECTED.replace("<think>add</think>", "<think></think>")


def test_preserve_thinking_keeps_every_reasoning(tok):
    text = tok.apply_chat_template(CONVERSATION, tokenize=False, preserve_thinking=True)
    assert text == EXPECTED.replace("<think></think>Hello!", "<think>greet them</think>Hello!")


def test_tool_calls_keep_reasoning_within_the_current_turn(tok):
    call = {"id": "functions.add:0", "type": "function", "function": {"name": "add", "arguments": {"a": 2}}}
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "", "reasoning_content": "use a tool", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "functions.add:0", "content": "4"},
        {"role": "assistant", "content": "4", "reasoning_content": "done"},
    ]
    tools = [{"type": "function", "function": {"name": "add"}}]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False)
    assert text == (
        "<|im_system|>tool_declare<|im_middle|>" + json.dumps(tools) + "<|im_end|>"
        "<|im_system|>system<|im_middle|>S<|im_end|>"
        "<|im_user|>user<|im_middle|>Q<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>use a tool</think>"
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>"
        '{"a": 2}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
        "<|im_system|>tool<|im_middle|>## Return of functions.add:0\n4<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>done</think>4<|im_end|>"
    )


def test_build_is_deterministic_and_reloads_offline(tok, tmp_path):
    assert build_kimi_tokenizer().get_vocab() == tok.get_vocab()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.apply_chat_template(CONVERSATION, tokenize=False) == EXPECTED
    assert loaded.encode("<|im_middle|>hello") == tok.encode("<|im_middle|>hello")
    assert len(loaded) == len(tok)
