"""``dsrun --config FILE``: the whole config checked before anything starts.

The launcher validates the file with the runtime's own rules
(:func:`dsrun.runtime.config.resolve`, which imports no torch), for the
data-parallel size the job will have: every mistake - bad JSON, an unknown
key (with its did-you-mean), a wrong value, a batch size that does not
divide - is one usage error (exit 2) naming ``FILE:LINE`` where the key is,
and no rank starts.

What only the ranks know is not held against the file: an ``"auto"``
micro batch size comes from the script's dataloader, so the batch triple
is then only checked for what any micro batch size needs; and a script may
train with fewer data-parallel ranks than the world size (pipeline or
model parallelism through an ``mpu``), so a batch size that fits the world
size or one of its divisors passes - with a warning when it does not fit the
world size itself, the data-parallel size of a plain data-parallel script.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from typing import Any

from dsrun.errors import DsrunConfigError, DsrunUsageError

MICRO = "train_micro_batch_size_per_gpu"


def check_config(path: str, world_size: int, environ: Mapping[str, str]) -> str | None:
    """Raise DsrunUsageError naming ``path:line`` when the config is invalid;
    return a warning when it is valid only at a data-parallel size below
    ``world_size`` (None: nothing to say)."""
    from dsrun.runtime import config as cfg
    from dsrun.runtime.config_load import json_hint

    text = _read(path)
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        raise DsrunUsageError(f"--config {path}:{exc.lineno}:{exc.colno}: not valid JSON: "
                              f"{exc.msg}{json_hint(path, text)}") from None
    try:
        raw, _ = cfg.load_config(path)  # duplicate keys, not an object, inf/NaN
    except DsrunConfigError as exc:
        line = line_of(text, error_path(str(exc)))
        raise DsrunUsageError(f"--config {path}:{line}: {exc}" if line else
                              f"--config {exc}") from None
    view = launcher_view(raw)
    quiet = logging.getLogger("dsrun.runtime.config")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # warnings are the ranks' to give, once each
    try:
        first = _try(cfg, view, world_size, environ)
        if first is None:
            return None
        fits = next((dp for dp in sorted(_divisors(world_size), reverse=True)
                     if _try(cfg, view, dp, environ) is None), None)
    finally:
        quiet.setLevel(level)
    message = str(first).replace(cfg.DICT_SOURCE, path)
    line = line_of(text, error_path(message))
    where = f"{path}:{line}" if line else path
    if fits is None:
        raise DsrunUsageError(f"--config {where}: {message}")
    return (f"warning: --config {where}: {message}; it fits {fits} data-parallel rank(s), "
            "so the job fails unless the script trains with pipeline or model parallelism")


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8-sig") as f:  # a BOM is read, as initialize() does
            return f.read()
    except OSError as exc:
        raise DsrunUsageError(f"--config {path!r}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise DsrunUsageError(f"--config {path}: not UTF-8 text ({exc.reason})") from None


def _try(cfg: Any, view: dict[str, Any], dp: int,
         environ: Mapping[str, str]) -> DsrunConfigError | None:
    try:
        cfg.resolve(view, dp_size=dp, dp_source=f"WORLD_SIZE={dp}, the ranks dsrun starts",
                    environ=environ)
    except DsrunConfigError as exc:
        return exc
    return None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n) if n % d == 0]


def launcher_view(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The config as far as the launcher can judge it: an ``"auto"`` micro
    batch (the dataloader's batch size, known only in the ranks) is left out
    when the global batch size is given - then only what every micro batch
    size needs is checked - and taken as 1 otherwise."""
    view = dict(raw)
    if isinstance(view.get(MICRO), str) and view[MICRO].lower() == "auto":
        train = view.get("train_batch_size")
        if isinstance(train, int) and not isinstance(train, bool):
            del view[MICRO]
        else:
            view[MICRO] = 1
    return view


_UNKNOWN = re.compile(r'unknown key "([^"]+)"(?: in "([^"]+)" of)?')
_WHERE = re.compile(r'^"([^"]+)" in ')


def error_path(message: str) -> tuple[str, ...]:
    """The key path a config error message names, () if none (pure)."""
    found = _UNKNOWN.search(message)
    if found:
        section = tuple(found.group(2).split(".")) if found.group(2) else ()
        return (*section, found.group(1))
    found = _WHERE.search(message)
    if found:
        return tuple(found.group(1).split("."))
    for key in ("train_batch_size", MICRO, "gradient_accumulation_steps"):
        if key in message:
            return (key,)
    return ()


def line_of(text: str, path: tuple[str, ...]) -> int | None:
    """Line of key ``path`` in JSON ``text``; for an array element (no key of
    its own) the line of the nearest key above it (pure)."""
    lines = key_lines(text)
    while path:
        if path in lines:
            return lines[path]
        path = path[:-1]
    return None


def key_lines(text: str) -> dict[tuple[str, ...], int]:
    """Line (1-based) of each object key in JSON ``text``, by key path
    (array elements by their index); the first occurrence wins (pure)."""
    lines: dict[tuple[str, ...], int] = {}
    stack: list[list[Any]] = []  # [kind, current key or index, expecting a key]
    i, line, n = 0, 1, len(text)
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
        elif c == '"':
            end = _string_end(text, i)
            if stack and stack[-1][0] == "{" and stack[-1][2]:
                try:
                    stack[-1][1] = json.loads(text[i:end + 1])
                except ValueError:
                    stack[-1][1] = text[i + 1:end]
                lines.setdefault(tuple(str(f[1]) for f in stack), line)
            line += text.count("\n", i, end)
            i = end
        elif c in "{[":
            stack.append([c, None if c == "{" else 0, c == "{"])
        elif c in "}]" and stack:
            stack.pop()
        elif c == ":" and stack:
            stack[-1][2] = False
        elif c == "," and stack:
            if stack[-1][0] == "{":
                stack[-1][2] = True
            else:
                stack[-1][1] += 1
        i += 1
    return lines


def _string_end(text: str, start: int) -> int:
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == '"':
            return i
        i += 1
    return len(text) - 1
