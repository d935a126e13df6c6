"""A finished run directory and its export, as the trainer leaves them (tiny sizes)."""

import json

import pytest
import torch
from omegaconf import OmegaConf

from eagle31.export import export_drafter
from eagle31.recipe import RunConfig
from tests.helpers import tiny_drafter

REPORT = {
    "tau_sim": 3.2145,
    "acc": [0.81, 0.72, 0.6],
    "tokens_seen": 1234567,
    "steps": 1000,
    "acceptance": {  # eagle31.acceptance.run_acceptance's report
        "settings": {"mode": "chain", "k": 3, "max_new_tokens": 64},
        "results": [{"drafter": "run", "split": "eval", "prompts": 16, "tau": 2.91, "acceptance_rate": [0.8, 0.6, 0.45]}],
    },
}


@pytest.fixture
def run_dir(tmp_path):
    """runs/demo with config.yaml, drafter/ (native, with the target's embedding, as the pipeline saves it) and report.json."""
    run = tmp_path / "runs" / "demo"
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
    return export_drafter(tiny_drafter(seed=1, dtype=torch.float32), run_dir / "export" / "eagle3",
                          target_name_or_path="moonshotai/Kimi-K2.6")
