"""Generic machinery of the config layer: value checks, key matching, errors.

Config sections are frozen dataclasses whose fields carry their JSON key,
aliases and a :class:`Check` (made with :func:`opt` / :func:`section`);
:func:`validate_fields` type-checks and freezes them at construction and
:func:`parse_section` builds one from a JSON object, sending unknown keys
to :class:`Ctx` (an error with a did-you-mean suggestion, or a warning when
unknown keys are allowed). Every message names the key and its source.
Nothing here knows DeepSpeed's sections (see :mod:`config_sections`) and
nothing imports torch.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, is_dataclass
from types import MappingProxyType
from typing import Any, Optional, Union

from dsrun.errors import DsrunConfigError

log = logging.getLogger("dsrun.runtime.config")


class _FirstRankOnly(logging.Filter):
    """Every rank reads the same config, so what parsing it has to say
    (ignored keys, settings without effect, deprecations) is said once: by
    global rank 0, or wherever there is no rank (a plain script, the
    launcher's check). Errors are raised, not logged, on every rank."""

    def filter(self, record: logging.LogRecord) -> bool:
        dist = sys.modules.get("torch.distributed")  # never imported for this
        if dist is not None and dist.is_available() and dist.is_initialized():
            return dist.get_rank() == 0
        return os.environ.get("RANK", "0") == "0"


log.addFilter(_FirstRankOnly())

AUTO = "auto"
ALLOW_UNKNOWN_ENV = "DSRUN_ALLOW_UNKNOWN_CONFIG_KEYS"
DICT_SOURCE = "config dict"
ConfigInput = Union[str, "os.PathLike[str]", Mapping[str, Any]]

# --------------------------------------------------------------- value checks


@dataclass(frozen=True)
class Check:
    """What one config value may be. ``kind``: int, float, bool, str,
    floats (a number or a list of numbers), mapping, json (anything)."""

    kind: str
    low: Optional[float] = None
    high: Optional[float] = None
    choices: tuple[str, ...] = ()
    optional: bool = False


def show(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _describe(spec: Check) -> str:
    if spec.choices:
        text = "one of " + ", ".join(f'"{c}"' for c in spec.choices)
    else:
        text = {"int": "an integer", "float": "a number", "bool": "true or false",
                "str": "a string", "floats": "a number or a list of numbers",
                "mapping": "a JSON object", "json": "a JSON value"}[spec.kind]
    if spec.low is not None and spec.high is not None:
        text += f" in [{spec.low:g}, {spec.high:g}]"
    elif spec.low is not None:
        text += f" >= {spec.low:g}"
    return text + (" or null" if spec.optional else "")


def is_auto(value: Any) -> bool:
    """True for the string "auto" (safe for tensors and arrays)."""
    return isinstance(value, str) and value == AUTO


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _convert(value: Any, spec: Check) -> tuple[bool, Any]:
    """(ok, normalised value). JSON writes 5e8 for integers, so integral
    floats are accepted where an integer is expected."""
    kind = spec.kind
    if kind == "int":
        if _is_number(value) and math.isfinite(value) and float(value).is_integer():
            return True, int(value)
        return False, value
    if kind == "float":
        ok = _is_number(value) and math.isfinite(value)
        return (True, float(value)) if ok else (False, value)
    if kind == "floats":
        if isinstance(value, (list, tuple)) and value and all(
                _is_number(v) and math.isfinite(v) for v in value):
            return True, tuple(float(v) for v in value)
        return _convert(value, Check("float"))
    if kind == "bool":
        return isinstance(value, bool), value
    if kind == "str":
        return isinstance(value, str) and (not spec.choices or value in spec.choices), value
    if kind == "mapping":
        return isinstance(value, Mapping), value
    return True, value


def _nonfinite(value: Any) -> bool:
    """An inf or NaN number, or a list holding one."""
    items = value if isinstance(value, (list, tuple)) else (value,)
    return any(_is_number(v) and not math.isfinite(v) for v in items)


def _in_range(value: Any, spec: Check) -> bool:
    items = value if isinstance(value, tuple) else (value,)
    for item in items:
        if not _is_number(item):
            continue
        if spec.low is not None and item < spec.low:
            return False
        if spec.high is not None and item > spec.high:
            return False
    return True


def check_value(value: Any, spec: Check, where: str) -> Any:
    """Return ``value`` normalised to ``spec`` or raise naming ``where``."""
    if value is None and spec.optional:
        return None
    if is_auto(value) and not spec.choices and spec.kind not in ("str", "any"):
        raise DsrunConfigError(f'{where} is "auto", which dsrun cannot resolve for this key; '
                               f"give {_describe(spec)}")
    ok, normalised = _convert(value, spec)
    if not ok and spec.kind in ("int", "float", "floats") and _nonfinite(value):
        # an inf lr or loss scale trains NaNs or skips every step, silently
        raise DsrunConfigError(f"{where} must be a finite number, got {show(value)}")
    if not ok or not _in_range(normalised, spec):
        raise DsrunConfigError(f"{where} must be {_describe(spec)}, got {show(value)}")
    return normalised


def freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return MappingProxyType({k: freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [thaw(v) for v in value]
    return value


def opt(kind: str, default: Any, *, key: Optional[str] = None, aliases: tuple[str, ...] = (),
         low: Optional[float] = None, high: Optional[float] = None,
         choices: tuple[str, ...] = (), optional: bool = False) -> Any:
    """A dataclass field carrying its JSON key and its :class:`Check`."""
    spec = Check(kind, low, high, choices, optional or default is None)
    return field(default=default, metadata={"check": spec, "key": key, "aliases": aliases})


def subsection(cls: type, *, optional: bool = False) -> Any:
    meta = {"section": cls, "key": None, "aliases": ()}
    if optional:
        return field(default=None, metadata=meta)
    return field(default_factory=cls, metadata=meta)


def json_key(f: Any) -> str:
    return f.metadata.get("key") or f.name


def validate_fields(obj: Any) -> None:
    """Type-check (and normalise) every field of a frozen config dataclass."""
    for f in fields(obj):
        value = getattr(obj, f.name)
        where = f"{type(obj).__name__}.{f.name}"
        if "check" in f.metadata:
            object.__setattr__(obj, f.name, freeze(check_value(value, f.metadata["check"], where)))
        elif "section" in f.metadata:
            cls = f.metadata["section"]
            if not (value is None or isinstance(value, cls)):
                raise DsrunConfigError(f"{where} must be a {cls.__name__}, got {value!r}")
        elif isinstance(value, (Mapping, list)):
            object.__setattr__(obj, f.name, freeze(value))


def did_you_mean(word: str, choices: Any) -> str:
    """'; did you mean "x"?' for the closest of ``choices`` (ignoring case), else ''."""
    folded = {str(c).lower(): str(c) for c in choices}
    match = difflib.get_close_matches(str(word).lower(), list(folded), n=1, cutoff=0.6)
    return f'; did you mean "{folded[match[0]]}"?' if match else ""


@dataclass
class Ctx:
    """Where values come from, and what to do with unknown keys."""

    source: str
    allow_unknown: bool = False
    ignored: list[str] = field(default_factory=list)

    def where(self, path: tuple[str, ...]) -> str:
        return f'"{".".join(path)}" in {self.source}'

    def unknown(self, key: str, path: tuple[str, ...], valid: Any, belongs: str = "") -> None:
        section = f' in "{".".join(path)}" of ' if path else " in "
        text = f'unknown key "{key}"{section}{self.source}'
        hint = did_you_mean(key, valid)
        text += f'; it belongs in "{belongs}"' if belongs else hint
        if not hint and not belongs:
            text += "; valid keys: " + ", ".join(sorted(valid))
        if not self.allow_unknown:
            raise DsrunConfigError(f'{text} (to only warn, set {{"dsrun": {{"allow_unknown_keys": '
                                   f"true}}}} or {ALLOW_UNKNOWN_ENV}=1)")
        log.warning("%s; ignoring it", text)
        self.ignored.append(".".join((*path, key)))


STRICT = Ctx("the config")


def pick(raw: Any, path: tuple[str, ...], ctx: Ctx, valid: Any,
          belongs: Union[tuple[Any, str], Mapping[str, str], None] = None) -> dict[str, Any]:
    """The known keys of section ``raw``; unknown ones go to ``ctx.unknown``.
    ``belongs``: (keys, section) or {key: section} - where a misplaced key
    goes, said instead of a did-you-mean."""
    if not isinstance(raw, Mapping):
        raise DsrunConfigError(f"{ctx.where(path)} must be a JSON object, got {show(raw)}")
    homes = belongs if isinstance(belongs, Mapping) else \
        dict.fromkeys(belongs[0], belongs[1]) if belongs else {}
    known = {}
    for key, value in raw.items():
        if key in valid:
            known[key] = value
        else:
            ctx.unknown(str(key), path, valid, homes.get(key, ""))
    return known


def parse_section(cls: type, raw: Any, path: tuple[str, ...], ctx: Ctx) -> Any:
    """Build config dataclass ``cls`` from JSON section ``raw``."""
    by_key = {}
    for f in fields(cls):
        for key in (json_key(f), *f.metadata.get("aliases", ())):
            by_key[key] = f
    kwargs: dict[str, Any] = {}
    for key, value in pick(raw, path, ctx, by_key).items():
        f, sub = by_key[key], (*path, key)
        if f.name in kwargs:
            raise DsrunConfigError(f'{ctx.where(sub)}: "{json_key(f)}" is given twice '
                                   "(under two spellings)")
        if "section" in f.metadata:
            cls_ = f.metadata["section"]
            value = None if value is None else parse_section(cls_, value, sub, ctx)
        kwargs[f.name] = check_value(value, f.metadata["check"], ctx.where(sub)) \
            if "check" in f.metadata else value
    return build(cls, kwargs, ctx)


def build(cls: type, kwargs: dict[str, Any], ctx: Ctx) -> Any:
    try:
        return cls(**kwargs)
    except DsrunConfigError as err:
        if ctx.source in str(err):
            raise
        raise DsrunConfigError(f"{err} (in {ctx.source})") from None


def to_dict(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        # None is left out where it is the default; elsewhere it is a setting
        if f.metadata.get("internal") or (value is None and f.default is None):
            continue
        out[json_key(f)] = to_dict(value) if is_dataclass(value) else thaw(value)
    return out


_SECRET_WORDS = ("api_key", "token", "secret", "password")


def redact_secrets(value: Any) -> Any:
    """``value`` (a config dict) with every set string under a key that names
    a secret (``api_key``, ``*token*``, ...) replaced by ``"<redacted>"``: for
    logs and for the config a checkpoint keeps (the input is left alone)."""
    if isinstance(value, dict):
        return {k: "<redacted>" if isinstance(v, str) and any(w in str(k).lower()
                                                              for w in _SECRET_WORDS)
                else redact_secrets(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_secrets(v) for v in value]
    return value
