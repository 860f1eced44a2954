"""``deepspeed.utils.logging``'s "once" helpers, ``print_dist`` and
``print_configuration`` as dsrun gives them (DeepSpeed attaches
``warning_once`` and ``log_dist_once`` to its logger)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator

import pytest

from dsrun.utils import logger
from dsrun.utils import logging as ds_logging


@pytest.fixture(autouse=True)
def forget() -> Iterator[None]:
    ds_logging.warning_once.cache_clear()
    ds_logging._log_dist_once.cache_clear()
    yield
    ds_logging.warning_once.cache_clear()
    ds_logging._log_dist_once.cache_clear()


def messages(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records]


def test_warning_once_warns_once_per_message(caplog: pytest.LogCaptureFixture) -> None:
    assert logger.warning_once is ds_logging.warning_once
    with caplog.at_level(logging.INFO, logger=logger.name):
        for _ in range(3):
            logger.warning_once("slow path %s", "x")
        logger.warning_once("another")
        ds_logging.warning_once("slow path %s", "x")
    assert messages(caplog) == [(logging.WARNING, "slow path x"),
                                (logging.WARNING, "another")]
    assert caplog.records[0].pathname == __file__  # the caller's line, not dsrun's


def test_log_dist_once_logs_once_per_message_ranks_and_level(
        caplog: pytest.LogCaptureFixture) -> None:
    assert logger.log_dist_once is ds_logging.log_dist_once
    with caplog.at_level(logging.INFO, logger=logger.name):
        for _ in range(2):
            logger.log_dist_once("hello", ranks=[0])  # a list: made hashable
            ds_logging.log_dist_once("hello", ranks=[0], level=logging.WARNING)
    # no process group here: the one process logs, as rank 0
    assert messages(caplog) == [(logging.INFO, "[Rank 0] hello"),
                                (logging.WARNING, "[Rank 0] hello")]


def test_print_dist_prints_whatever_the_level(capsys: pytest.CaptureFixture[str]) -> None:
    ds_logging.print_dist("step 3", ranks=[0])
    assert capsys.readouterr().out == "[Rank 0] step 3\n"


def test_print_configuration_lists_sorted_attributes(caplog: pytest.LogCaptureFixture) -> None:
    args = argparse.Namespace(lr=0.001, batch_size=8)
    with caplog.at_level(logging.INFO, logger=logger.name):
        ds_logging.print_configuration(args, "arguments")
    assert [m for _, m in messages(caplog)] == [
        "arguments:", "  batch_size " + "." * 19 + " 8", "  lr " + "." * 27 + " 0.001"]


def test_log_dist_once_is_importable_from_deepspeed_utils() -> None:
    import dsrun.utils

    assert dsrun.utils.log_dist_once is ds_logging.log_dist_once
