"""Replace a dataset's assistant turns with the target's own replies, before prepare.py.

    python data_prep/regenerate.py recipe=smollm2_135m
    python data_prep/regenerate.py recipe=demo regenerate.source=chats.jsonl regenerate.max_new_tokens=128
    torchrun --nproc-per-node 8 data_prep/regenerate.py recipe=llama31_8b regenerate.source=sharegpt:
    # a served target (vLLM / SGLang, OpenAI-compatible; OPENAI_API_KEY is sent when set); README shows
    # the `vllm serve` line for Kimi K2.6 with its reasoning parser
    python data_prep/regenerate.py recipe=kimi_k26 regenerate.backend=endpoint \
        regenerate.endpoint=http://localhost:8000/v1 regenerate.source=sharegpt: \
        regenerate.max_new_tokens=16384 regenerate.concurrency=256

Reads `regenerate.source` (the first `regenerate.max_conversations`), asks the target
(`target.builtin` / `target.path` in this process, or the endpoint) for every assistant
turn, turn by turn, with `data.system_prompt` (or one of `data.system_prompts` per conversation,
drawn from `regenerate.seed`) and `data.chat_template_kwargs` (the prompt training renders; with
`data.chat_template_variants`, one variant drawn per conversation, kept in its record for prepare), and
writes `regenerate.output_dir` (docs/regeneration.md):
`conversations/` is the `data.source` of the next step. Rerunning resumes: finished
shards are kept. Bad settings, and a server refusing requests, stop with one line and
exit code 2 before any shard is written; a server still down after
`regenerate.restart_window_s` stops with exit code 1 (rerun to resume).
"""

import sys
from itertools import islice
from pathlib import Path

from omegaconf import OmegaConf
from tqdm import tqdm

from eagle31.data.prepare import template_kwargs, template_variants
from eagle31.data.regenerate.backends import EndpointBackend, HFBackend
from eagle31.data.regenerate.core import RegenerateError, Settings
from eagle31.data.regenerate.pool import regenerate
from eagle31.data.regenerate.shards import prepare_output, write_report
from eagle31.data.sources import DataError, Tally, check_sources, read_conversations, resolve_sources
from eagle31.data.system_prompts import data_system_prompts
from eagle31.distributed import barrier, close_world, init_world
from eagle31.errors import ConfigError
from eagle31_cli import recipe_main

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def main(cfg) -> None:
    r = cfg.regenerate
    sources = resolve_sources(r.source)
    if not sources:
        raise ConfigError("regenerate.source is empty: give conversation files, a datasets directory or sharegpt:")
    if r.backend == "endpoint" and not r.endpoint:
        raise ConfigError("regenerate.backend=endpoint needs regenerate.endpoint (e.g. http://localhost:8000/v1)")
    if r.max_conversations is not None and r.max_conversations < 1:
        raise ConfigError(f"regenerate.max_conversations must be >= 1 or null, got {r.max_conversations}")
    # the prompt training renders: data.system_prompt(s), data.chat_template_kwargs and data.chat_template_variants
    variants = template_variants(cfg.data) if OmegaConf.select(cfg, "data.chat_template_variants") else None
    settings = Settings(
        max_new_tokens=r.max_new_tokens,
        max_turns=r.max_turns,
        max_prompt_tokens=r.max_prompt_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        seed=r.seed,
        shard_size=r.shard_size,
        chat_template_kwargs=template_kwargs(cfg.data) or None,
        system_prompts=data_system_prompts(cfg.data) or None,
        chat_template_variants=variants,
        on_length=r.on_length,
    )
    check_sources(sources)
    world = init_world(r.device if r.backend == "hf" else "cpu")
    try:
        if r.backend == "hf":
            from eagle31.targets import resolve_target_path

            target = resolve_target_path(cfg.target)
            generator = cfg.target.name or str(target)
        else:
            generator = f"{r.endpoint} {r.model or ''}".strip()
        identity = {"sources": sources, "max_conversations": r.max_conversations, "generator": generator}
        if world.is_main:
            prepare_output(r.output_dir, settings, identity)
        barrier()
        if r.backend == "hf":
            backend = HFBackend(target, settings, device=str(world.device), batch_size=r.batch_size)
        else:
            backend = EndpointBackend(
                r.endpoint,
                settings,
                model=r.model,
                concurrency=r.concurrency,
                timeout_s=r.timeout_s,
                retries=r.retries,
                backoff_s=r.backoff_s,
                restart_window_s=r.restart_window_s,
            )
        rejects = Tally()
        conversations = list(islice(read_conversations(sources, rejects), r.max_conversations))
        if not conversations:
            raise DataError(f"no readable conversation in {', '.join(sources)}: {rejects.describe() or 'empty'}")
        with tqdm(
            total=len(conversations), desc=f"regenerate (rank {world.rank})", unit="conv", disable=not world.is_main
        ) as bar:
            try:
                counts = regenerate(
                    conversations,
                    backend,
                    r.output_dir,
                    settings,
                    rank=world.rank,
                    world_size=world.world_size,
                    progress=bar.update,
                )
            except RegenerateError as e:
                print(f"error: {e}; finished shards are kept, rerun to resume", file=sys.stderr)
                raise SystemExit(1) from None
        barrier()
        if world.is_main:
            report = write_report(r.output_dir, rejects, len(conversations))
            print(
                f"regenerated {report['conversations_out']} of {report['conversations_in']} conversations "
                f"({report['turns']} replies, {report['reasoning_turns']} with reasoning, {report['replies_cut']} cut "
                f"at max_new_tokens, on_length={settings.on_length}) into {r.output_dir}/conversations; "
                f"this run wrote {counts['written']} shards, kept {counts['skipped']}"
            )
            for kind in ("dropped", "truncated"):
                for reason, entry in report[kind].items():
                    print(f"{kind} {reason}: {entry['count']} [{', '.join(entry['examples'])}]")
    finally:
        close_world()


if __name__ == "__main__":
    sys.exit(recipe_main(main, RECIPES, sys.argv[1:], usage=__doc__))
