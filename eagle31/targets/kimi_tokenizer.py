"""A small local tokenizer with Kimi K2.x's special tokens and chat format (docs/demo_target.md)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

KIMI_MINI_VOCAB = 512  # BPE ids before the special tokens

# Kimi's special tokens (its ids 163584 and up); added after the BPE vocabulary.
KIMI_SPECIAL_TOKENS = (
    "[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|media_begin|>", "<|media_content|>", "<|media_end|>",
    "<|media_pad|>", "<think>", "</think>", "[UNK]", "[PAD]",
)  # fmt: skip
_NAMED_SPECIAL_TOKENS = ("[BOS]", "<|im_end|>", "[UNK]", "[PAD]")  # bos, eos, unk, pad

KIMI_CHAT_TEMPLATE = """
{%- set default_system = 'You are Kimi, an AI assistant created by Moonshot AI.' -%}

{%- macro render_content(content) -%}
  {%- if content is string -%}
    {{- content -}}
  {%- elif content is not none -%}
    {%- for part in content if part.type == 'text' -%}{{- part.text -}}{%- endfor -%}
  {%- endif -%}
{%- endmacro -%}

{%- macro header(message) -%}
  {%- set kind = message.role if message.role in ['user', 'assistant'] else 'system' -%}
  {{- '<|im_' + kind + '|>' + (message.get('name') or message.role) + '<|im_middle|>' -}}
{%- endmacro -%}

{%- macro render_tool_calls(tool_calls) -%}
  {{- '<|tool_calls_section_begin|>' -}}
  {%- for call in tool_calls -%}
    {%- set arguments = call.function.arguments -%}
    {{- '<|tool_call_begin|>' + call.id + '<|tool_call_argument_begin|>' -}}
    {{- arguments if arguments is string else arguments | tojson -}}
    {{- '<|tool_call_end|>' -}}
  {%- endfor -%}
  {{- '<|tool_calls_section_end|>' -}}
{%- endmacro -%}

{#- History ends with the last completed answer (assistant without tool calls), a
    final message included; preserve_thinking makes nothing history. -#}
{%- set ns = namespace(history_end=-1) -%}
{%- if not preserve_thinking -%}
  {%- for i in range(messages | length) -%}
    {%- if messages[i].role == 'assistant' and not messages[i].get('tool_calls') -%}
      {%- set ns.history_end = i -%}
    {%- endif -%}
  {%- endfor -%}
{%- endif -%}

{%- if tools -%}
  {{- '<|im_system|>tool_declare<|im_middle|>' + (tools | tojson) + '<|im_end|>' -}}
{%- endif -%}
{%- if not messages or messages[0].role != 'system' -%}
  {{- '<|im_system|>system<|im_middle|>' + default_system + '<|im_end|>' -}}
{%- endif -%}

{%- for message in messages -%}
  {{- header(message) -}}
  {%- if message.role == 'assistant' -%}
    {%- set keep = loop.index0 > ns.history_end and thinking is not false -%}
    {%- set reasoning = message.get('reasoning_content') or message.get('reasoning') or '' -%}
    {{- '<think>' + (reasoning if keep else '') + '</think>' -}}
    {{- render_content(message.content) -}}
    {%- if message.get('tool_calls') -%}
      {{- render_tool_calls(message.tool_calls) -}}
    {%- endif -%}
  {%- elif message.role == 'tool' -%}
    {{- '## Return of ' + message.tool_call_id + '\\n' + render_content(message.content) -}}
  {%- else -%}
    {{- render_content(message.content) -}}
  {%- endif -%}
  {{- '<|im_end|>' -}}
{%- endfor -%}

{%- if add_generation_prompt -%}
  {{- '<|im_assistant|>assistant<|im_middle|>' -}}
  {{- '<think></think>' if thinking is false else '<think>' -}}
{%- endif -%}
"""

# Fixed training text for the BPE: chat-like English and a little Python, so the
# merges are plausible. Changing it changes every id: it is part of the format.
_BPE_TEXT = """\
You are Kimi, an AI assistant created by Moonshot AI. The user asks a question and
the assistant answers it. Let me think about this step by step before I answer.
The answer is the sum of the two numbers, so the result is forty two.
Hello! How can I help you today? Please explain what this function does.
Speculative decoding lets a small draft model propose several tokens that the
large target model then verifies in a single forward pass. When the draft is
right, many tokens are accepted at once and generation becomes faster.
The weather today is sunny with a light wind from the west, and tomorrow it will
rain in the morning and clear up in the afternoon.
def add(a, b):
    \"\"\"Return the sum of a and b.\"\"\"
    return a + b

def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(i, i * i)
import json, os, sys
data = {"name": "search", "arguments": {"query": "latest news", "limit": 5}}
Tool results come back as messages, and the assistant uses them to answer.
1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14159 0.5 -1 + - * / = < > ( ) [ ] { } , . : ; ! ?
"""


def build_kimi_tokenizer() -> PreTrainedTokenizerFast:
    """A deterministic byte-level BPE with Kimi's special tokens and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=KIMI_MINI_VOCAB, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    # repeated so that frequent pairs outrank one-off ones by a clear margin
    tok.train_from_iterator([_BPE_TEXT] * 4, trainer=trainer)
    tok.add_special_tokens(list(KIMI_SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="[BOS]", eos_token="<|im_end|>", unk_token="[UNK]", pad_token="[PAD]",
        additional_special_tokens=[t for t in KIMI_SPECIAL_TOKENS if t not in _NAMED_SPECIAL_TOKENS],
        chat_template=KIMI_CHAT_TEMPLATE, model_max_length=262144,
    )  # fmt: skip
