"""Loss masks from chat templates, against golden supervised spans checked by hand."""

import pytest

from eagle31.data.chat import ChatEncoder, ChatTemplateError, ReasoningTally
from eagle31.data.sources import to_conversation
from eagle31.errors import ConfigError
from tests.data.chat_helpers import build_tokenizer, supervised_spans


def conv(*messages, **record):
    return to_conversation({"messages": list(messages), **record})


def encode(tok, c, **kw):
    ids, mask = ChatEncoder(tok, **kw).encode(c)
    assert len(ids) == len(mask)
    return ids, mask


MULTI_TURN = conv(
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!", "reasoning_content": "greet them"},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "add them"},
)


# ---------------------------------------------------------------- Llama 3 style


def test_llama3_multi_turn_supervises_assistant_content_and_eot(llama_tok):
    ids, mask = encode(llama_tok, MULTI_TURN)
    assert llama_tok.decode(ids) == (
        "<|begin_of_text|>"
        "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n4<|eot_id|>"
    )
    assert supervised_spans(llama_tok, ids, mask) == ["Hello!<|eot_id|>", "4<|eot_id|>"]


def test_llama3_last_turn_only(llama_tok):
    ids, mask = encode(llama_tok, MULTI_TURN, last_turn_only=True)
    assert supervised_spans(llama_tok, ids, mask) == ["4<|eot_id|>"]


def test_system_prompt_is_added_only_when_missing(llama_tok):
    plain = conv({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"})
    ids, mask = encode(llama_tok, plain, system_prompt="Be kind.")
    assert llama_tok.decode(ids).startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe kind.<|eot_id|>"
    )
    assert supervised_spans(llama_tok, ids, mask) == ["Hello!<|eot_id|>"]
    ids, _ = encode(llama_tok, MULTI_TURN, system_prompt="Be kind.")
    assert "Be kind." not in llama_tok.decode(ids) and "Be brief." in llama_tok.decode(ids)


def test_trailing_user_turn_and_no_assistant(llama_tok):
    c = conv(
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    )
    ids, mask = encode(llama_tok, c)
    assert supervised_spans(llama_tok, ids, mask) == ["Hello!<|eot_id|>"]
    _, mask = encode(llama_tok, conv({"role": "user", "content": "Hi"}))
    assert not any(mask)


def test_sharegpt_and_openai_forms_give_the_same_tokens(llama_tok, kimi_tok):
    turns = [("system", "S"), ("human", "Hi"), ("gpt", "Hello!"), ("human", "Bye"), ("gpt", "Ciao")]
    sharegpt = to_conversation({"conversations": [{"from": f, "value": v} for f, v in turns]})
    openai = conv(
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Ciao"},
    )
    for tok in (llama_tok, kimi_tok):
        assert encode(tok, sharegpt) == encode(tok, openai)


# ---------------------------------------------------------------- Kimi K2.6


K26 = {"preserve_thinking": True}  # what recipe=kimi_k26 sets in data.chat_template_kwargs


def test_kimi_default_render_drops_all_reasoning_and_counts_it(kimi_tok):
    encoder = ChatEncoder(kimi_tok)
    ids, mask = encoder.encode(MULTI_TURN)
    assert kimi_tok.decode(ids) == (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>Hello!<|im_end|>"
        "<|im_user|>user<|im_middle|>2+2?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>4<|im_end|>"
    )
    assert supervised_spans(kimi_tok, ids, mask) == ["</think>Hello!<|im_end|>", "</think>4<|im_end|>"]
    reasoning_tokens = len(kimi_tok("greet them")["input_ids"]) + len(kimi_tok("add them")["input_ids"])
    assert encoder.reasoning == ReasoningTally(
        turns=2, tokens=reasoning_tokens, unrendered_turns=2, unrendered_tokens=reasoning_tokens
    )


def test_kimi_preserve_thinking_supervises_every_reasoning(kimi_tok):
    encoder = ChatEncoder(kimi_tok, template_kwargs=K26)
    ids, mask = encoder.encode(MULTI_TURN)
    assert "<think>greet them</think>Hello!" in kimi_tok.decode(ids)
    # the generation prompt ends with `<think>`, so the model generates from there on
    assert supervised_spans(kimi_tok, ids, mask) == [
        "greet them</think>Hello!<|im_end|>",
        "add them</think>4<|im_end|>",
    ]
    assert encoder.reasoning.turns == 2 and encoder.reasoning.unrendered_turns == 0
    ids, mask = encode(kimi_tok, MULTI_TURN, last_turn_only=True, template_kwargs=K26)
    assert supervised_spans(kimi_tok, ids, mask) == ["add them</think>4<|im_end|>"]


@pytest.mark.parametrize("answer", ["Hel", ""])  # cut in the answer; cut while thinking
def test_a_cut_reply_leaves_the_closing_tokens_unsupervised(kimi_tok, answer):
    cut = {"role": "assistant", "content": answer, "reasoning_content": "greet them", "finish_reason": "length"}
    conversation = to_conversation({"messages": [{"role": "user", "content": "Hi"}, cut]})
    assert conversation.messages[-1]["finish_reason"] == "length"  # sources keeps the mark
    ids, mask = ChatEncoder(kimi_tok, template_kwargs=K26).encode(conversation)
    assert kimi_tok.decode(ids).endswith(f"<think>greet them</think>{answer}<|im_end|>")
    # the target wrote neither the `</think>` nor the end of turn the template closes the reply with
    assert supervised_spans(kimi_tok, ids, mask) == [f"greet them</think>{answer}" if answer else "greet them"]


@pytest.mark.parametrize("answer", ["Hel", ""])  # cut in the answer; cut while thinking
def test_a_cut_reply_leaves_a_think_marker_that_is_not_a_special_token_unsupervised(answer):
    """Qwen3's `<think>` and `</think>` are added tokens, not special ones: a reply cut while thinking is closed
    by the template with a `</think>` the target never wrote, which is not supervised either."""
    tok = build_tokenizer(
        "{%- for m in messages -%}{{ '<|im_start|>' + m.role + '\n' }}"
        "{%- if m.reasoning_content -%}{{ '<think>\n' + m.reasoning_content + '\n</think>\n\n' }}{%- endif -%}"
        "{{ m.content + '<|im_end|>\n' }}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}",
        ["<|im_start|>", "<|im_end|>"],
    )
    tok.add_tokens(["<think>", "</think>"])  # added, not special (Qwen3's tokenizer.json)
    assert not any(t.special for t in tok.added_tokens_decoder.values() if t.content == "</think>")
    cut = {"role": "assistant", "content": answer, "reasoning_content": "greet them", "finish_reason": "length"}
    ids, mask = ChatEncoder(tok).encode(to_conversation({"messages": [{"role": "user", "content": "Hi"}, cut]}))
    assert tok.decode(ids).endswith(f"<think>\ngreet them\n</think>\n\n{answer}<|im_end|>\n")
    assert supervised_spans(tok, ids, mask) == [
        f"<think>\ngreet them\n</think>\n\n{answer}" if answer else "<think>\ngreet them"
    ]


def test_kimi_history_reasoning_equal_to_the_final_one(kimi_tok):
    same = conv(
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "2", "reasoning_content": "add"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "add"},
    )
    ids, mask = encode(kimi_tok, same, template_kwargs=K26)
    assert supervised_spans(kimi_tok, ids, mask) == ["add</think>2<|im_end|>", "add</think>4<|im_end|>"]
    ids, mask = encode(kimi_tok, same)
    assert supervised_spans(kimi_tok, ids, mask) == ["</think>2<|im_end|>", "</think>4<|im_end|>"]


def test_kimi_default_and_custom_system_prompt(kimi_tok):
    c = conv({"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "reasoning": "greet"})
    ids, mask = encode(kimi_tok, c, template_kwargs=K26)
    assert kimi_tok.decode(ids) == (
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
        "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>greet</think>Hello!<|im_end|>"
    )
    assert supervised_spans(kimi_tok, ids, mask) == ["greet</think>Hello!<|im_end|>"]
    ids, mask = encode(kimi_tok, c, system_prompt="Be kind.", template_kwargs=K26)
    assert kimi_tok.decode(ids).startswith("<|im_system|>system<|im_middle|>Be kind.<|im_end|><|im_user|>")
    assert supervised_spans(kimi_tok, ids, mask) == ["greet</think>Hello!<|im_end|>"]


def test_kimi_tool_calls_keep_reasoning_and_tool_results_are_not_supervised(kimi_tok):
    c = conv(
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "ask the tool",
            "tool_calls": [{"id": "w:0", "type": "function", "function": {"name": "w", "arguments": '{"c":1}'}}],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "w:0"},
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "read it"},
    )
    call = (
        '<|tool_calls_section_begin|><|tool_call_begin|>w:0<|tool_call_argument_begin|>{"c":1}<|tool_call_end|>'
        "<|tool_calls_section_end|><|im_end|>"
    )
    ids, mask = encode(kimi_tok, c, template_kwargs=K26)
    assert "<|im_system|>tool<|im_middle|>## Return of w:0\nsunny<|im_end|>" in kimi_tok.decode(ids)
    assert supervised_spans(kimi_tok, ids, mask) == ["ask the tool</think>" + call, "read it</think>Sunny.<|im_end|>"]
    # without preserve_thinking the answer makes the whole turn history: no reasoning at all
    ids, mask = encode(kimi_tok, c)
    assert supervised_spans(kimi_tok, ids, mask) == ["</think>" + call, "</think>Sunny.<|im_end|>"]


def test_template_kwargs_that_are_render_arguments_are_refused(kimi_tok):
    with pytest.raises(ConfigError, match="data.chat_template_kwargs: 'add_generation_prompt'"):
        ChatEncoder(kimi_tok, template_kwargs={"add_generation_prompt": True})
    with pytest.raises(ConfigError, match="must be a mapping"):
        ChatEncoder(kimi_tok, template_kwargs=["preserve_thinking"])


# ---------------------------------------------------------------- other templates

ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>", "<think>"]


def test_prefilled_scaffold_and_whitespace_after_end_of_turn():
    # DeepSeek-R1 style: the prompt prefills "<think>\n", recorded turns have none;
    # ChatML style: a newline after each end-of-turn token.
    tok = build_tokenizer(
        "{%- for m in messages -%}{{ '<|' + m.role + '|>' + m.content + '<|end|>\n' }}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|assistant|><think>\n' }}{%- endif -%}",
        ROLE_TOKENS,
    )
    ids, mask = encode(tok, MULTI_TURN)
    assert supervised_spans(tok, ids, mask) == ["Hello!<|end|>", "4<|end|>"]


def test_final_turn_scaffold_that_history_turns_lack():
    # Qwen3 style: turns after the last user message show their reasoning, and the
    # final one always has a think block (empty without reasoning); earlier turns have none.
    tok = build_tokenizer(
        "{%- set ns = namespace(last_user=-1) -%}"
        "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
        "{%- endfor -%}"
        "{%- for m in messages -%}{{ '<|' + m.role + '|>' }}"
        "{%- set r = m.reasoning_content or '' -%}"
        "{%- if m.role == 'assistant' and loop.index0 > ns.last_user and (loop.last or r) -%}"
        "{{ '<think>' + r + '</think>' }}{%- endif -%}"
        "{{ m.content + '<|end|>\n' }}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}",
        ROLE_TOKENS + ["</think>"],
    )
    ids, mask = encode(tok, MULTI_TURN)
    assert tok.decode(ids).count("<think>") == 1
    assert supervised_spans(tok, ids, mask) == ["Hello!<|end|>", "<think>add them</think>4<|end|>"]


def test_template_whose_prefixes_disagree_is_rejected():
    tok = build_tokenizer(
        "{{ '<|system|>' + (messages | length | string) }}"  # every prefix renders a different first line
        "{%- for m in messages -%}{{ '<|' + m.role + '|>' + m.content + '<|end|>' }}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}",
        ROLE_TOKENS,
    )
    with pytest.raises(ChatTemplateError) as e:
        encode(tok, MULTI_TURN)
    assert e.value.reason == "unstable_template"


def test_template_exception_is_a_template_error():
    tok = build_tokenizer(
        "{%- for m in messages -%}{%- if m.role == 'system' -%}{{ raise_exception('no system role') }}{%- endif -%}"
        "{{ m.content }}{%- endfor -%}",
        ROLE_TOKENS,
    )
    with pytest.raises(ChatTemplateError) as e:
        encode(tok, MULTI_TURN)
    assert e.value.reason == "template_error" and "no system role" in e.value.detail


def test_tokenizer_without_template_is_a_config_error():
    with pytest.raises(ConfigError, match="no chat template"):
        ChatEncoder(build_tokenizer(None, ROLE_TOKENS))
