"""``--local_rank`` for DeepSpeed-style scripts, without a flag.

DeepSpeed's launcher appends ``--local_rank=N`` to every rank's arguments,
and tutorial scripts declare it (``parser.add_argument("--local_rank",
type=int, default=-1)``) and read ``args.local_rank``. Under dsrun such a
script gets the local rank from the injected runtime instead: while the
script runs, an ``argparse`` parser that parses the command line (no
explicit ``args``) and declares ``--local_rank`` or ``--local-rank`` gets
``--local_rank=N`` in front of the arguments when the command line does
not already give it. Nothing changes for parsers that do not declare it,
for explicit argument lists, or when the command line names it. ``dsrun
--no_local_rank`` (DeepSpeed's flag) turns this off; ``--local_rank_arg``
puts the argument on the real command line, for scripts that read
``sys.argv`` by hand.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

#: The option spellings that get filled in (DeepSpeed's, torch.distributed.launch's).
SPELLINGS = ("--local_rank", "--local-rank")

_original_parse_known_args = argparse.ArgumentParser.parse_known_args
_local_rank: int | None = None


def filled_args(parser: argparse.ArgumentParser, args: Sequence[str],
                local_rank: int) -> list[str]:
    """``args`` with ``--local_rank=N`` in front when ``parser`` declares the
    option and ``args`` do not give it (pure)."""
    action = next((parser._option_string_actions[s] for s in SPELLINGS
                   if s in parser._option_string_actions), None)
    if action is None:
        return list(args)
    given = set(action.option_strings)
    for arg in args:
        if arg == "--":
            break
        if arg.split("=", 1)[0] in given:
            return list(args)
    spelling = next(s for s in SPELLINGS if s in given)
    return [f"{spelling}={local_rank}", *args]


def _parse_known_args(self: argparse.ArgumentParser, args: Sequence[str] | None = None,
                      namespace: Any = None) -> Any:
    if args is None and _local_rank is not None:
        args = filled_args(self, sys.argv[1:], _local_rank)
    return _original_parse_known_args(self, args, namespace)


def install(local_rank: int) -> None:
    """Fill in ``--local_rank`` for the parsers of the running script."""
    global _local_rank
    _local_rank = local_rank
    argparse.ArgumentParser.parse_known_args = _parse_known_args  # type: ignore[method-assign]


def uninstall() -> None:
    global _local_rank
    _local_rank = None
    argparse.ArgumentParser.parse_known_args = (  # type: ignore[method-assign]
        _original_parse_known_args)
