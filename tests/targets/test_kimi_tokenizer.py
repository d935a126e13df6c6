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

EXPECTED = (  # Kimi K2.5/K2.6 by default: no reasoning up to and including the last answer
    "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
    "<|im_user|>user<|im_middle|>Hi<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><think></think>Hello!<|im_end|>"
    "<|im_user|>user<|im_middle|>2+2?<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><think></think>4<|im_end|>"
)
PRESERVED = EXPECTED.replace("<think></think>Hello!", "<think>greet them</think>Hello!").replace(
    "<think></think>4", "<think>add</think>4"
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


def test_history_up_to_and_including_the_last_answer_renders_no_reasoning(tok):
    # the final answer is history too, as in Kimi's template (hist_msgs ends at the last answer)
    assert tok.apply_chat_template(CONVERSATION, tokenize=False) == EXPECTED
    single = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
    ]
    assert "<think></think>Hello!" in tok.apply_chat_template(single, tokenize=False)


def test_preserve_thinking_renders_every_reasoning(tok):
    assert tok.apply_chat_template(CONVERSATION, tokenize=False, preserve_thinking=True) == PRESERVED


def test_generation_prompt_then_generation_is_the_full_render_only_with_preserve_thinking(tok):
    prompt = tok.apply_chat_template(
        CONVERSATION[:-1], tokenize=False, add_generation_prompt=True, preserve_thinking=True
    )
    assert prompt.endswith("<|im_assistant|>assistant<|im_middle|><think>")
    assert prompt + "add</think>4<|im_end|>" == PRESERVED
    # by default the earlier answer's reasoning is history in the prompt as well
    prompt = tok.apply_chat_template(CONVERSATION[:-1], tokenize=False, add_generation_prompt=True)
    assert prompt + "</think>4<|im_end|>" == EXPECTED


def test_default_system_prompt_and_instant_mode(tok):
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True, thinking=False
    )
    assert text == (
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
        "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>"
    )
    assert tok.apply_chat_template(CONVERSATION, tokenize=False, thinking=False, preserve_thinking=True) == EXPECTED


CALL = {"id": "functions.add:0", "type": "function", "function": {"name": "add", "arguments": {"a": 2}}}
TOOLS = [{"type": "function", "function": {"name": "add"}}]
TOOL_TURN = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "Q"},
    {"role": "assistant", "content": "", "reasoning_content": "use a tool", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "functions.add:0", "content": "4"},
]
TOOL_TURN_TEXT = (
    "<|im_system|>tool_declare<|im_middle|>" + json.dumps(TOOLS) + "<|im_end|>"
    "<|im_system|>system<|im_middle|>S<|im_end|>"
    "<|im_user|>user<|im_middle|>Q<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><think>use a tool</think>"
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0<|tool_call_argument_begin|>"
    '{"a": 2}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
    "<|im_system|>tool<|im_middle|>## Return of functions.add:0\n4<|im_end|>"
)


def test_tool_call_steps_after_the_last_answer_keep_their_reasoning(tok):
    prompt = tok.apply_chat_template(TOOL_TURN, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert prompt == TOOL_TURN_TEXT + "<|im_assistant|>assistant<|im_middle|><think>"


def test_an_answer_makes_the_tool_call_steps_before_it_history(tok):
    done = [*TOOL_TURN, {"role": "assistant", "content": "4", "reasoning_content": "done"}]
    text = tok.apply_chat_template(done, tools=TOOLS, tokenize=False)
    answer = "<|im_assistant|>assistant<|im_middle|><think>{}</think>4<|im_end|>"
    assert text == TOOL_TURN_TEXT.replace("<think>use a tool</think>", "<think></think>") + answer.format("")
    kept = tok.apply_chat_template(done, tools=TOOLS, tokenize=False, preserve_thinking=True)
    assert kept == TOOL_TURN_TEXT + answer.format("done")


def test_build_is_deterministic_and_reloads_offline(tok, tmp_path):
    assert build_kimi_tokenizer().get_vocab() == tok.get_vocab()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.apply_chat_template(CONVERSATION, tokenize=False) == EXPECTED
    assert loaded.encode("<|im_middle|>hello") == tok.encode("<|im_middle|>hello")
    assert len(loaded) == len(tok)
