"""The GPU check (benchmarks/gpu_check.py): its plan, budgets, failures, offline install, summary,
and the whole check on CPU with tiny shapes (`--cpu-smoke`), so that it cannot rot between GPU runs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from benchmarks import attention_check, gpu_check, gpu_parts
from benchmarks.fetch_gpu_wheels import platform_tags, project_requirements
from benchmarks.report import put_gpu_table
from benchmarks.sequence_parallel import drafter_config
from benchmarks.shapes import recipe_drafter, recipe_shapes
from eagle31.kernels.causal import CausalMask, FlashCausal
from eagle31.model import Visibility
from eagle31.sequence_parallel.query_tail import QueryTail
from tests.peers import peer_module

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # the memory estimate of three recipes' drafters decides where to checkpoint: a minute of traces
def test_the_gpu_plan_reads_its_runs_from_the_recipes():
    shapes = recipe_shapes().values()
    kimi = next(s.recipe for s in shapes if "Kimi-K2.6" in s.target and s.attention == "llama")
    mla = [s.recipe for s in shapes if s.attention == "mla"]
    parts = gpu_check.plan(smoke=False, gpu_memory_gib=139.8)  # an H200
    assert [p.name for p in parts][:4] == ["attention", "trainer", "memory", "sequence parallel"]
    fixed = [gpu_check.ENVIRONMENT, *(p for p in parts if p.kind != "benchmark")]
    assert sum(p.budget_s for p in fixed) <= gpu_check.BUDGET_S  # the benchmark runs get what these leave
    runs = [p.args for p in parts if p.kind == "benchmark"]
    assert [f"shape={kimi}", "ttt=7", "T=4096", "ckpt=false", "peer=speculators", "warmup=2", "repeats=5"] in runs
    assert any(f"shape={kimi}" in a and "T=65536" in a and "ckpt=true" in a for a in runs)
    assert any(f"shape={kimi}" in a and "T=16384" in a and "ckpt=false" in a and "peer=speculators" in a for a in runs)
    assert any("shape=llama31_8b" in a and "T=4096" in a for a in runs)
    assert any("shape=llama31_8b" in a and "parallel=true" in a for a in runs)  # a P-EAGLE drafter's step
    smaller = [p.args for p in gpu_check.plan(smoke=False, gpu_memory_gib=40) if p.kind == "benchmark"]
    assert any("T=16384" in a and "ckpt=true" in a for a in smaller)  # checkpointing where the GPU needs it
    if mla:
        assert any(f"shape={m}" in a for a in runs for m in mla)
    else:  # until a recipe trains an MLA drafter, the check says so instead of failing
        unavailable = [p.args[0] for p in parts if p.kind == "unavailable"]
        assert any("MLA" in reason and reason.startswith("not available") for reason in unavailable)


def part_that_never_ends(smoke: bool, out: Path) -> dict:
    """A part (kind `module:function`) over any budget, however fast the machine: it waits for what never comes."""
    import threading

    threading.Event().wait()


def test_a_part_over_its_budget_is_stopped_and_recorded(tmp_path):
    (tmp_path / "parts").mkdir()
    (tmp_path / "logs").mkdir()
    endless = gpu_check.Part("endless", f"{__name__}:part_that_never_ends", 2)
    started = time.monotonic()
    result = gpu_check.run_part(endless, tmp_path, smoke=True, timeout=2)
    assert result["status"] == "timeout" and "budget of 2 s" in result["error"]
    assert time.monotonic() - started < 30  # stopped at its budget, not waited for


def test_a_failing_part_writes_its_error(tmp_path):
    result = tmp_path / "part.json"
    assert gpu_check.part_main("benchmark", result, tmp_path, True, ["shape=gpt5"]) == 1
    report = json.loads(result.read_text())
    assert report["status"] == "fail" and "gpt5" in report["error"]


@pytest.mark.slow
def test_the_sequence_parallel_part_runs_the_sequence_parallel_path_at_one_rank_with_the_same_loss():
    report = gpu_parts.sequence_parallel(smoke=True)
    plain, split = report["paths"]["plain"], report["paths"]["sequence_parallel"]
    assert report["status"] == "pass", report
    assert plain["exchanged_bytes_per_step"] == 0 and split["exchanged_bytes_per_step"] > 0  # its collectives ran
    assert split["loss"] == plain["loss"] and report["step_ratio"] > 0 and report["peak_ratio"] > 0
    assert report["shard_attention"]["passed"] and max(report["shard_attention"]["max_error"].values()) < 1e-4


def test_the_shard_attention_check_catches_a_lost_block_of_earlier_keys(monkeypatch):
    cfg = drafter_config("mla", 64)
    assert gpu_parts.shard_attention(cfg, 64, 4, torch.device("cpu"), torch.float32, "flash")["passed"]
    blocks = QueryTail.prefix_blocks.__func__
    monkeypatch.setattr(QueryTail, "prefix_blocks", classmethod(lambda cls, *args: list(blocks(cls, *args))[1:]))
    monkeypatch.setattr(
        QueryTail, "prefix_block", staticmethod(lambda nh, d: 8)
    )  # several blocks: the first is dropped
    report = gpu_parts.shard_attention(cfg, 64, 4, torch.device("cpu"), torch.float32, "flash")
    assert not report["passed"] and report["max_error"]["output"] > 1e-2


def test_bad_arguments_exit_2(tmp_path, capsys):
    assert gpu_check.main([]) == 2
    (tmp_path / "notes.txt").write_text("mine")
    assert gpu_check.main(["--cpu-smoke", str(tmp_path)]) == 2  # a folder of other files is not overwritten
    assert "not an empty directory" in capsys.readouterr().err


def test_private_op_signatures_are_checked_before_use(monkeypatch):
    assert attention_check.private_op_problems(torch.device("cpu")) == []
    ops = {
        "_scaled_dot_product_flash_attention_for_cpu": (("Tensor", "Tensor", "Tensor", "int"), 2),
        "_no_such_attention_op": ((), 1),
    }
    monkeypatch.setitem(attention_check.PRIVATE_OPS, "cpu", ops)
    problems = attention_check.private_op_problems(torch.device("cpu"))
    assert len(problems) == 2
    assert "aten._scaled_dot_product_flash_attention_for_cpu is `" in problems[0]
    assert "no torch.ops.aten._no_such_attention_op" in problems[1]


def test_a_benchmark_runs_on_the_blockwise_kernel_when_the_private_ops_differ(monkeypatch):
    monkeypatch.setitem(attention_check.PRIVATE_OPS, "cpu", {"_no_such_attention_op": ((), 1)})
    result = gpu_parts.benchmark(["shape=tiny", "T=32", "ttt=2", "warmup=0", "repeats=1", "memory=false"])
    assert result["status"] == "pass" and result["config"]["attention"] == "blockwise"
    assert set(result["attention_parity"]) == {"blockwise"}
    assert "_no_such_attention_op" in result["flash"]


def test_the_attention_check_catches_a_wrong_kernel(monkeypatch):
    cfg = recipe_drafter("llama31_8b")  # 32 / 8 heads of 128: GQA at a real shape
    report = attention_check.check_attention_parity(cfg, torch.device("cpu"), torch.float32, seq_len=48)
    assert set(report) == {"flash", "blockwise"} and max(report["flash"].values()) < 1e-4
    forward = FlashCausal.forward

    def off_by_a_bit(q, k, v, segments, scale, mask):
        out, lse, ctx = forward(q, k, v, segments, scale * 1.01, mask)
        return out, lse, ctx

    monkeypatch.setattr(FlashCausal, "forward", staticmethod(off_by_a_bit))
    with pytest.raises(RuntimeError, match="'flash' disagrees"):
        attention_check.check_attention_parity(cfg, torch.device("cpu"), torch.float32, seq_len=48)


def test_the_attention_check_of_a_windowed_drafter_catches_a_kernel_that_ignores_the_window(monkeypatch):
    cfg = recipe_drafter("kimi_k26_llama")  # its 2,048-position window, checked as 16 of the 48 positions
    assert cfg.sliding_window == 2048
    report = attention_check.check_attention_parity(cfg, torch.device("cpu"), torch.float32, seq_len=48)
    assert max(report["flash"].values()) < 1e-4 and max(report["blockwise"].values()) < 1e-4
    forward = FlashCausal.forward
    monkeypatch.setattr(
        FlashCausal,
        "forward",
        staticmethod(
            lambda q, k, v, segments, scale, mask: forward(q, k, v, segments, scale, CausalMask(Visibility(), 0))
        ),
    )
    with pytest.raises(RuntimeError, match="'flash' disagrees"):
        attention_check.check_attention_parity(cfg, torch.device("cpu"), torch.float32, seq_len=48)


def _probe_wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel, `gpu_check_probe` 1.0, as pip builds them."""
    path = folder / "gpu_check_probe-1.0-py3-none-any.whl"
    info = "gpu_check_probe-1.0.dist-info"
    files = {
        "gpu_check_probe/__init__.py": "VALUE = 1\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: gpu-check-probe\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in {**files, f"{info}/RECORD": record}.items():
            z.writestr(name, text)
    return path


@pytest.mark.slow
def test_missing_packages_are_installed_from_the_wheel_folder_without_network(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _probe_wheel(wheels)
    (wheels / "requirements.txt").write_text("gpu-check-probe\n")
    (wheels / "requirements-no-deps.txt").write_text("gpu-check-probe==1.0\n")
    target = tmp_path / "site"
    monkeypatch.setenv("PIP_TARGET", str(target))  # install into a folder, not into the test's environment
    monkeypatch.setenv("PIP_UPGRADE", "1")
    monkeypatch.setattr(gpu_check, "NEEDED_MODULES", ("gpu_check_probe",))
    (tmp_path / "logs").mkdir()
    report = gpu_check.install_wheels(wheels, tmp_path / "logs" / "install.log")
    assert report["status"] == "pass", (tmp_path / "logs" / "install.log").read_text()
    assert report["was_missing"][0] == "gpu_check_probe"
    assert (target / "gpu_check_probe" / "__init__.py").is_file()
    monkeypatch.delenv("PIP_TARGET")
    skipped = gpu_check.install_wheels(None, tmp_path / "logs" / "install.log")
    assert skipped["status"] == "skipped" and "fetch_gpu_wheels" in skipped["detail"]


def test_the_wheel_list_leaves_torch_to_the_gpu_machine():
    requirements = project_requirements()
    assert any(r.startswith("transformers") for r in requirements)
    assert not any(r.startswith(("torch", "wandb")) for r in requirements)
    assert platform_tags("manylinux_2_28_x86_64")[:2] == ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64"]
    assert platform_tags("manylinux_2_28_x86_64")[-2:] == ["manylinux_2_17_x86_64", "manylinux2014_x86_64"]


@pytest.mark.slow
def test_cpu_smoke_runs_every_part_and_writes_the_summary(tmp_path):
    peer_module("speculators.models.eagle3.core")  # the side-by-side part's peer
    out = tmp_path / "check"
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--cpu-smoke", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    parts = summary["parts"]
    assert [p["status"] for p in parts.values()] == ["pass"] * 7, parts
    assert all(s["passed"] for s in parts["memory"]["memory_shapes"].values())
    assert parts["environment"]["torch"] == torch.__version__
    assert all(s["status"] == "pass" for s in parts["attention"]["shapes"].values())
    assert {"kimi_k26", "llama31_8b"} <= set(parts["attention"]["shapes"])
    assert all(parts["trainer"]["checks"].values())
    assert parts["sequence parallel"]["loss_relative_difference"] == 0
    bench = parts["benchmark tiny T=128"]
    assert bench["runs"]["eagle31"]["step_s"] > 0 and bench["flops_per_step"] > 0
    assert parts["benchmark tiny parallel T=128"]["runs"]["eagle31"]["step_s"] > 0  # a parallel drafter trains
    assert "| tiny | 128 | 2 | no |" in (out / "summary.md").read_text()

    doc = tmp_path / "performance.md"
    doc.write_text(
        "# Performance\n\n## GPU\n\n<!-- gpu-check:start -->\nnot measured yet\n<!-- gpu-check:end -->\n\n## After\n"
    )
    put_gpu_table(doc, summary)
    put_gpu_table(doc, summary)  # replaced, not repeated
    text = doc.read_text()
    assert "not measured yet" not in text and text.count("| tiny | 128 |") == 1 and text.endswith("## After\n")
