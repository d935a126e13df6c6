"""The one-time demo target build says what it does, once, with phases and an ETA."""

import logging

import pytest

from eagle31.cli import show_progress_lines
from eagle31.targets import demo_corpus
from eagle31.targets.demo import DemoRecipe, ensure_demo_target

SMALL = DemoRecipe(
    corpus=demo_corpus.CorpusSpec(heldout=8, max_train=48, long_prompts=2, long_prompt_turns=2),
    vocab_size=512,
    steps=3,
    batch_tokens=2048,
    eval_greedy_prompts=2,
    eval_greedy_tokens=8,
)


@pytest.mark.slow  # a small build: about a minute on 2 busy cores
def test_the_build_announces_itself_once_then_reports_each_phase(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("EAGLE31_CACHE", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="eagle31"):
        ensure_demo_target(seed=0, recipe=SMALL)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("eagle31")]
    assert lines[0].startswith("building the demo target, once: it is cached in " + str(tmp_path / "targets"))
    assert "reused by later runs" in lines[0]
    phases = [line.split("] ")[0] for line in lines if line.startswith("demo target [")]
    assert sorted(set(phases)) == [f"demo target [{i}/5" for i in range(1, 6)]
    steps = [line for line in lines if "step " in line]
    assert steps[0].startswith("demo target [3/5] step 1/3, loss ") and "ETA " in steps[0]
    assert steps[-1].endswith("ETA 0:00") and lines[-1].startswith("demo target built in ")

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="eagle31"):
        ensure_demo_target(seed=0, recipe=SMALL)  # cached: silent
    assert not [r for r in caplog.records if r.name.startswith("eagle31")]


def test_the_clis_show_the_progress_lines_bare(capsys):
    logger = logging.getLogger("eagle31")
    before, level = list(logger.handlers), logger.level
    try:
        show_progress_lines()
        show_progress_lines()  # idempotent: one handler
        added = [h for h in logger.handlers if h not in before]
        assert len(added) == 1 and logger.level == logging.INFO
        record = logging.LogRecord("eagle31.targets.demo", logging.INFO, "", 0, "demo target [%d/5] corpus", (1,), None)
        assert added[0].format(record) == "demo target [1/5] corpus"
    finally:
        for h in logger.handlers[len(before):]:
            logger.removeHandler(h)
        logger.setLevel(level)
