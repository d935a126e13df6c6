"""Shared test settings (nothing may reach the network; small deterministic sizes) and the fixtures
used across folders: locally built chat tokenizers, a finished run directory and its export."""

import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Two workers share two cores, so a test computes on one thread, its subprocesses too (training runs, torchrun
# ranks, vLLM engines, Ray workers): an OpenMP team wider than its free cores waits at every barrier for a thread
# that the other worker's process holds off the CPU (CONTRIBUTING.md has the figures). vLLM's CPU engine would pin
# its thread to the last core, both workers' engines to the same one: it is left unpinned.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.deadline import pytest_runtest_protocol  # noqa: E402, F401  (the `deadline` marker's hook)
from tests.schedule import (  # noqa: E402, F401  (the longest files first)
    pytest_addoption,
    pytest_collection_modifyitems,
    pytest_configure,
)

torch.set_num_threads(1)  # OMP_NUM_THREADS above may be set otherwise by the user: the tests' own process, one thread


@pytest.fixture(scope="session")
def llama_tok():
    from tests.data.chat_helpers import LLAMA3_SPECIAL, LLAMA3_TEMPLATE, build_tokenizer

    return build_tokenizer(LLAMA3_TEMPLATE, LLAMA3_SPECIAL, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")


@pytest.fixture(scope="session")
def kimi_tok():
    from eagle31.targets.kimi_tokenizer import build_kimi_tokenizer

    return build_kimi_tokenizer()


@pytest.fixture(scope="session")
def llama_tok_dir(llama_tok, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama_tok")
    llama_tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_target(llama_tok, tmp_path_factory) -> Path:
    """A random 8-layer Llama with a local Llama-3-style tokenizer, as the recipe CLIs' `target.path`."""
    from tests.tiny_targets import save_chat_target

    return save_chat_target(tmp_path_factory.mktemp("tiny_target"), llama_tok)


@pytest.fixture(scope="session")
def chats(tmp_path_factory) -> Path:
    """48 two-turn conversations the tiny target trains on."""
    from tests.data.chat_helpers import write_jsonl

    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    records = []
    for i in range(48):
        a, b = i % 7, i % 5
        records.append(
            {
                "messages": [
                    {"role": "user", "content": f"What is {a} plus {b}? Tell me about the weather."},
                    {
                        "role": "assistant",
                        "content": f"It is {a + b}. The weather is sunny and warm, with a light wind.",
                    },
                ]
            }
        )
    return write_jsonl(path, records)


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs: a real full disk (needs the right to mount, as root in a container has)."""
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    yield disk
    subprocess.run(["umount", "--lazy", str(disk)], check=True)  # a memory-mapped shard may still be open


REPORT = {
    "tau_sim": 3.2145,
    "acc": [0.81, 0.72, 0.6],
    "tokens_seen": 1234567,
    "steps": 1000,
    "acceptance": {  # eagle31.eval.acceptance.run_acceptance's report
        "settings": {"mode": "chain", "k": 3, "max_new_tokens": 64},
        "results": [
            {"drafter": "run", "split": "eval", "prompts": 16, "tau": 2.91, "acceptance_rate": [0.8, 0.6, 0.45]}
        ],
    },
}


@pytest.fixture
def run_dir(tmp_path):
    """runs/demo with config.yaml, drafter/ (native, with the target's embedding, as the pipeline saves it) and
    report.json."""
    run = tmp_path / "runs" / "demo"
    from omegaconf import OmegaConf

    from eagle31.recipe import RunConfig
    from tests.helpers import tiny_drafter

    cfg = OmegaConf.structured(RunConfig)
    cfg.target.name = "moonshotai/Kimi-K2.6"
    cfg.data.source = ["data/chat.jsonl", "org/dataset"]
    cfg.data.max_len = 3000
    cfg.hub.license = "mit"
    cfg.eval.num_speculative_tokens = 4
    run.mkdir(parents=True)
    OmegaConf.save(cfg, run / "config.yaml")
    tiny_drafter(seed=1, dtype=torch.float32).save(run / "drafter")
    (run / "report.json").write_text(json.dumps(REPORT))
    return run


@pytest.fixture
def export_dir(run_dir):
    """The run's drafter exported in the EAGLE-3 layout under <run>/export/eagle3."""
    from eagle31.export import export_drafter
    from tests.helpers import tiny_drafter

    return export_drafter(
        tiny_drafter(seed=1, dtype=torch.float32),
        run_dir / "export" / "eagle3",
        target_name_or_path="moonshotai/Kimi-K2.6",
    )


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster of 2 CPUs for the engine's tests (eagle31.engine), started once per session."""
    import logging

    import ray

    from eagle31.engine.cluster import NAMESPACE, init_ray

    init_ray(
        ray, num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR, namespace=NAMESPACE
    )
    yield ray
    ray.shutdown()
