"""The recipe CLIs show eagle31's progress lines (the one-time demo target build's, tests/targets/test_demo.py)."""

import logging

from eagle31_cli import show_progress_lines


def test_the_clis_show_the_progress_lines_bare(capsys):
    logger = logging.getLogger("eagle31")
    kept, level = list(logger.handlers), logger.level
    for h in kept:  # a CLI run earlier in this process may have added the handler already
        logger.removeHandler(h)
    try:
        show_progress_lines()
        show_progress_lines()  # idempotent: one handler
        added = list(logger.handlers)
        assert len(added) == 1 and logger.level == logging.INFO
        record = logging.LogRecord("eagle31.targets.demo", logging.INFO, "", 0, "demo target [%d/5] corpus", (1,), None)
        assert added[0].format(record) == "demo target [1/5] corpus"
    finally:
        for h in list(logger.handlers):
            logger.removeHandler(h)
        for h in kept:
            logger.addHandler(h)
        logger.setLevel(level)
