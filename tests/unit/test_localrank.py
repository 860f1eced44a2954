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


# ------------------------------------------------------------------ fire

def _train(steps: int = 1, local_rank: int = -1) -> tuple:
    return ("train", local_rank, steps)


def _no_rank(steps: int = 1, **kwargs: object) -> tuple:
    return ("no_rank", steps, kwargs)


class _Trainer:
    def __init__(self, local_rank: int = -1) -> None:
        self.local_rank = local_rank

    def fit(self, steps: int = 1) -> tuple:
        return ("fit", self.local_rank, steps)


class _Runner:
    def run(self, local_rank: int = -1) -> tuple:
        return ("run", local_rank)

    def other(self) -> tuple:
        return ("other",)


@pytest.mark.parametrize("component,args,expected", [
    (_train, ["--steps", "2"], ["--local_rank=3", "--steps", "2"]),
    (_train, [], ["--local_rank=3"]),
    (_Trainer, ["fit"], ["--local_rank=3", "fit"]),  # the class's __init__ takes it
    (_Runner, ["run", "--x=1"], ["--local_rank=3", "run", "--x=1"]),  # the method named
    (_Runner, ["--x=1", "other"], ["--x=1", "other"]),  # a method that does not take it
    (_Runner, ["--x", "4", "run"], ["--local_rank=3", "--x", "4", "run"]),  # 4: a value
    (_Runner, [], []),
    (_no_rank, ["--steps=2"], ["--steps=2"]),  # **kwargs is not a declaration
    ({"train": _train}, ["train"], ["train"]),  # fire reads argument 1 as a member name
    (_train, ["--local-rank=5"], ["--local-rank=5"]),  # given: any spelling fire reads
    (_train, ["--local_rank", "5"], ["--local_rank", "5"]),
])
def test_fire_filled_args(component, args, expected):
    assert localrank.fire_filled_args(component, args, 3) == expected


@pytest.fixture
def standin_fire(tmp_path, monkeypatch):
    """The stand-in fire package (tests/fire_standin.py: fire is not a
    dependency) on sys.path, imported fresh by the test and forgotten after."""
    from tests.fire_standin import write_fire_standin

    monkeypatch.syspath_prepend(str(write_fire_standin(tmp_path)))
    for name in ("fire", "fire.core"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield
    localrank.uninstall()
    for name in ("fire", "fire.core"):
        sys.modules.pop(name, None)


def test_fire_gets_local_rank_once_the_script_imports_it(standin_fire, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py", "--steps", "4"])
    localrank.install(2)
    assert "fire" not in sys.modules  # installing imports nothing
    import fire

    assert fire.Fire(_train) == ("train", 2, 4)
    assert fire.Fire(_Trainer, command=["fit"]) == ("fit", -1, 1)  # an explicit command
    monkeypatch.setattr(sys, "argv", ["train.py", "run"])
    assert fire.Fire(_Runner) == ("run", 2)
    monkeypatch.setattr(sys, "argv", ["train.py", "--local_rank=7", "--", "--verbose"])
    assert fire.Fire(_train) == ("train", 7, 1)
    # Fire() without a component still finds its caller's names
    monkeypatch.setattr(sys, "argv", ["train.py", "_train"])
    assert fire.Fire() == ("train", -1, 1)
    localrank.uninstall()
    monkeypatch.setattr(sys, "argv", ["train.py"])
    assert fire.Fire(_train) == ("train", -1, 1)


def test_fire_imported_before_install_is_patched_too(standin_fire, monkeypatch):
    import fire

    monkeypatch.setattr(sys, "argv", ["train.py"])
    localrank.install(1)
    assert fire.Fire(_train) == ("train", 1, 1)
