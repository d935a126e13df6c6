"""SpecForge's own trainer and exporter, run with the interpreter of SpecForge's venv (never eagle31's).

    <specforge venv>/bin/python experiments/side_by_side/specforge_entry.py <work dir>

`experiments.side_by_side.specforge_training` writes `<work dir>/inputs.json` (their run config, draft
config, vocabulary mapping, features) and starts this script; it imports nothing of eagle31.
It runs `specforge train` (their `specforge.cli.main`: config validation, assembly, offline
reader, sampler, collator, `OnlineEagle3Model` forward, `BF16Optimizer`, scheduler,
checkpoints) with one substitution: their KL kernel `specforge.core.loss.LogSoftmaxLoss` is a
Triton kernel, and Triton has no CPU driver ("0 active drivers"), so the EAGLE-3 model's loss
calls their pure-torch reference of the same quantity, `specforge.core.loss._compute_loss`,
instead (mean over all B*T rows of the masked -sum p log q, as the kernel returns; its
gradient is the kernel's backward). Then `specforge export --to hf` writes the drafter.

Prints one JSON object as its last stdout line: the step log (their `step N: {...}` lines),
the number of steps, and the tokens their sampler fed (replayed with their
`specforge.launch._distributed_sampler_indices`, the batches their loader drops last
excluded) and the wall time of `specforge train` (their start-up and torch.compile included).
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import re
import sys
import time
from pathlib import Path

STEP_LINE = re.compile(r"^step (\d+): (\{.*\})$")


class ReferenceKLLoss:
    """`LogSoftmaxLoss.apply`'s signature, computed by their reference implementation."""

    @staticmethod
    def apply(logits, target_p, position_mask):
        from specforge.core.loss import _compute_loss

        return _compute_loss(logits, target_p, position_mask)


class Tee(io.TextIOBase):
    """Their console output, kept for the step log and passed through."""

    def __init__(self, stream):
        self.stream, self.lines, self._part = stream, [], ""

    def write(self, text):
        self.stream.write(text)
        self._part += text
        *done, self._part = self._part.split("\n")
        self.lines += done
        return len(text)

    def flush(self):
        self.stream.flush()


def tokens_fed(lengths: list[int], batch_size: int, steps: int, seed: int) -> int:
    """Tokens of the documents in their first `steps` batches (their sampler's order per epoch)."""
    from specforge.launch import _distributed_sampler_indices

    total, step, epoch = 0, 0, 0
    while step < steps:
        order = _distributed_sampler_indices(len(lengths), dp_rank=0, dp_size=1, seed=seed, epoch=epoch)
        for start in range(0, len(order) - batch_size + 1, batch_size):  # drop_last=True
            total += sum(lengths[i] for i in order[start : start + batch_size])
            step += 1
            if step == steps:
                break
        epoch += 1
    return total


def main(work: Path) -> dict:
    import specforge.algorithms.eagle3.model as eagle3_model
    from specforge.cli import main as specforge_cli

    inputs = json.loads((work / "inputs.json").read_text())
    eagle3_model.LogSoftmaxLoss = ReferenceKLLoss
    tee = Tee(sys.stdout)
    started = time.perf_counter()
    with contextlib.redirect_stdout(tee):
        code = specforge_cli(["train", "--config", inputs["run_config"]])
    seconds = time.perf_counter() - started
    if code:
        raise SystemExit(f"specforge train exited with {code}")
    steps = [{"step": int(m[1]), **ast.literal_eval(m[2])} for m in map(STEP_LINE.match, tee.lines) if m]
    checkpoint = Path(inputs["output_dir"]) / f"{inputs['run_id']}-latest"  # their pointer to the last checkpoint
    export = [
        "export", "--to", "hf", "--checkpoint", str(checkpoint), "--draft-config", inputs["draft_config"],
        "--output-dir", inputs["drafter_dir"], "--vocab-mapping", inputs["vocab_mapping"],
        "--embedding-source", inputs["target_dir"],
    ]  # fmt: skip
    with contextlib.redirect_stdout(sys.stderr):
        code = specforge_cli(export)
    if code:
        raise SystemExit(f"specforge export exited with {code}")
    tokens = tokens_fed(inputs["lengths"], inputs["batch_size"], inputs["max_steps"], inputs["seed"])
    return {
        "steps": steps[-1]["step"] if steps else 0,
        "step_log": steps,
        "tokens_seen": tokens,
        "train_time_s": seconds,
    }


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
