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

Scripts that parse with ``fire`` (DeepSpeedExamples' HelloDeepSpeed:
``fire.Fire(train)`` with ``train(..., local_rank: int = -1)``) get the
same: when ``fire.Fire`` runs a function, or a class whose ``__init__`` or
whose method named on the command line has a ``local_rank`` parameter, on
the command line (``sys.argv[1:]``) without that flag, fire gets
``--local_rank=N`` in front, where DeepSpeed's launcher puts it. Only these
components work with DeepSpeed's flag in front, so only these get it; a
dict, module or instance component is left alone. fire is never imported
here: an import hook patches ``fire.core._Fire`` (the function
``fire.Fire`` hands the parsed command to, after it has looked up its
caller's frame) once the script imports fire.
"""

from __future__ import annotations

import argparse
import functools
import importlib.abc
import importlib.machinery
import inspect
import sys
import types
from collections.abc import Sequence
from typing import Any, Callable, Optional

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


# ------------------------------------------------------------------ fire

def _takes_local_rank(fn: Any) -> bool:
    """Whether calling ``fn`` takes a ``local_rank`` argument by name (a
    ``**kwargs`` catch-all does not count, as for argparse)."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False
    found = parameters.get("local_rank")
    return found is not None and found.kind not in (inspect.Parameter.VAR_POSITIONAL,
                                                    inspect.Parameter.VAR_KEYWORD)


def _fire_flag_gives_local_rank(arg: str) -> bool:
    # fire strips the dashes and reads '-' in a name as '_'
    return arg.startswith("-") and \
        arg.lstrip("-").split("=", 1)[0].replace("-", "_") == "local_rank"


def fire_filled_args(component: Any, args: Sequence[str], local_rank: int) -> list[str]:
    """``args`` (fire's, before its ``--`` separator) with ``--local_rank=N``
    in front when fire will call a function or build a class that takes
    ``local_rank``, or call the class's method that the first non-flag
    argument naming one names, and ``args`` do not give it (pure)."""
    if any(_fire_flag_gives_local_rank(arg) for arg in args):
        return list(args)
    if inspect.isclass(component):
        # the method is the first non-flag argument that names one: a flag's
        # value given after a space (--steps 3 train) is not a method name
        methods = (getattr(component, arg.replace("-", "_"), None)
                   for arg in args if not arg.startswith("-"))
        method = next((m for m in methods if inspect.isroutine(m)), None)
        wanted = _takes_local_rank(component) or (
            method is not None and _takes_local_rank(method))
    elif inspect.isroutine(component) or isinstance(component, functools.partial):
        wanted = _takes_local_rank(component)
    else:  # dicts, modules, instances: fire reads the first argument as a member name
        wanted = False
    return [f"--local_rank={local_rank}", *args] if wanted else list(args)


def _command_line_args() -> list[str]:
    """``sys.argv[1:]`` before its last ``--``: what ``fire.Fire`` hands on
    when it parses the command line."""
    args = sys.argv[1:]
    if "--" in args:
        return args[:len(args) - 1 - args[::-1].index("--")]
    return args


def _patched_fire(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def fire_with_local_rank(component: Any, args: Sequence[str], *rest: Any,
                             **kwargs: Any) -> Any:
        # an explicit command=[...] other than the command line is the script's own
        if _local_rank is not None and list(args) == _command_line_args():
            args = fire_filled_args(component, args, _local_rank)
        return original(component, args, *rest, **kwargs)

    fire_with_local_rank.__dsrun_original__ = original  # type: ignore[attr-defined]
    return fire_with_local_rank


def _patch_fire_core(module: types.ModuleType) -> None:
    original = getattr(module, "_Fire", None)
    if callable(original) and not hasattr(original, "__dsrun_original__"):
        module._Fire = _patched_fire(original)  # type: ignore[attr-defined]


class _PatchAfterLoad:
    """A loader that runs the real one, then patches the module."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[types.ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        _patch_fire_core(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, resource readers...
        return getattr(self._loader, name)


class _FireHook(importlib.abc.MetaPathFinder):
    """Patches ``fire.core`` when the script imports it (never imports it)."""

    def find_spec(self, fullname: str, path: Any, target: Any = None
                  ) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname != "fire.core":
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchAfterLoad(spec.loader)  # type: ignore[assignment]
                return spec
        return None


_fire_hook = _FireHook()


def install(local_rank: int) -> None:
    """Fill in ``--local_rank`` for the parsers of the running script."""
    global _local_rank
    _local_rank = local_rank
    argparse.ArgumentParser.parse_known_args = _parse_known_args  # type: ignore[method-assign]
    if "fire.core" in sys.modules:
        _patch_fire_core(sys.modules["fire.core"])
    elif _fire_hook not in sys.meta_path:
        sys.meta_path.insert(0, _fire_hook)


def uninstall() -> None:
    global _local_rank
    _local_rank = None
    argparse.ArgumentParser.parse_known_args = (  # type: ignore[method-assign]
        _original_parse_known_args)
    if _fire_hook in sys.meta_path:
        sys.meta_path.remove(_fire_hook)
    core = sys.modules.get("fire.core")
    patched = getattr(core, "_Fire", None)
    if hasattr(patched, "__dsrun_original__"):
        core._Fire = patched.__dsrun_original__  # type: ignore[union-attr]
