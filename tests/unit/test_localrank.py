"""--local_rank filled in for argparse parsers that declare it (runtime/localrank.py)."""

from __future__ import annotations

import argparse
import sys

import pytest

from dsrun.runtime import localrank


def _parser(*spellings: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    if spellings:
        p.add_argument(*spellings, type=int, default=-1, dest="local_rank")
    p.add_argument("--lr", type=float)
    p.add_argument("rest", nargs="*")
    return p


@pytest.mark.parametrize("spellings,args,expected", [
    (("--local_rank",), ["--lr", "1"], ["--local_rank=3", "--lr", "1"]),
    (("--local-rank",), [], ["--local-rank=3"]),
    (("--local_rank", "--local-rank"), ["x"], ["--local_rank=3", "x"]),
    (("--local_rank",), ["--local_rank", "5"], ["--local_rank", "5"]),
    (("--local_rank", "--local-rank"), ["--local-rank=5"], ["--local-rank=5"]),
    (("--local_rank",), ["--", "--local_rank=5"], ["--local_rank=3", "--", "--local_rank=5"]),
    ((), ["--lr", "1"], ["--lr", "1"]),
])
def test_filled_args(spellings, args, expected):
    assert localrank.filled_args(_parser(*spellings), args, 3) == expected


def test_installed_fill_in_applies_to_the_command_line_only(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py", "--lr", "0.5"])
    localrank.install(2)
    try:
        assert _parser("--local_rank").parse_args().local_rank == 2
        assert _parser("--local_rank").parse_args().lr == 0.5
        assert _parser("--local_rank").parse_known_args()[0].local_rank == 2
        # an explicit list is the script's own business
        assert _parser("--local_rank").parse_args(["--lr", "1"]).local_rank == -1
        # a parser without the option never sees it
        assert _parser().parse_args().rest == []
        monkeypatch.setattr(sys, "argv", ["train.py", "--local_rank=7"])
        assert _parser("--local_rank").parse_args().local_rank == 7
    finally:
        localrank.uninstall()
    monkeypatch.setattr(sys, "argv", ["train.py"])
    assert _parser("--local_rank").parse_args().local_rank == -1
