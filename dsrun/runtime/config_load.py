"""The edges of a raw DeepSpeed config: reading it, and what dsrun accepts
without acting on it.

:func:`load_config` turns a dict or a JSON path into a raw dict (bad JSON
and duplicate keys are errors naming the file). The unknown-key escape
hatch (:func:`_allow_unknown`), keys that older configs used and that mean
something else now (``REPLACED_KEYS``), dotted top-level keys as TRL adds them
(:func:`_drop_dotted`), documented DeepSpeed sections that
dsrun keeps verbatim but does not implement (``PASSTHROUGH_KEYS``; their
shape, the keys DeepSpeed 0.19.8 has removed and the Ulysses sizes are
checked by :mod:`.config_passthrough`) and top-level settings it checks but
ignores (``INERT_KEYS``, :func:`inert_settings`) are decided here.
:mod:`dsrun.runtime.config`
calls these from :func:`~dsrun.runtime.config.resolve` and re-exports them.
Nothing here imports torch.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import MISSING, fields
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from dsrun.errors import DsrunConfigError
from dsrun.runtime.config_passthrough import (
    PARALLEL_SIZE_KEYS,
    check_parallel_sizes,
    check_section,
    refuse_removed,
)
from dsrun.runtime.config_schema import (
    ALLOW_UNKNOWN_ENV,
    DICT_SOURCE,
    ConfigInput,
    Ctx,
    did_you_mean,
    is_auto,
    json_key,
    log,
    show,
)
from dsrun.runtime.config_sections import (
    DTYPE_NAMES,
    KEEP_IN_FP32_AUTO,
    BF16Config,
    FP16Config,
    ZeroConfig,
)

if TYPE_CHECKING:
    from dsrun.runtime.config import DsrunConfig

# Documented DeepSpeed sections dsrun accepts but does not act on (those
# DeepSpeed 0.19.8 has removed are refused: config_passthrough.REMOVED_KEYS).
PASSTHROUGH_KEYS = frozenset({
    "aio", "autotuning", "compile", "data_efficiency", "datastates_ckpt",
    "expert_parallel", "hybrid_engine", "tensor_parallel",
    "use_data_before_expert_parallelism", "weight_quantization", *PARALLEL_SIZE_KEYS,
})


def section_keys(top_level: Mapping[str, Any]) -> dict[str, str]:
    """{key: section} for the keys of ``zero_optimization``, ``fp16`` and
    ``bf16`` that are not top-level keys (``top_level``) too: a config that
    puts one at the top level is told where it belongs (``"stage"`` ->
    zero_optimization), not given a did-you-mean to some other key."""
    homes: dict[str, str] = {}
    for section, cls in (("zero_optimization", ZeroConfig), ("fp16", FP16Config),
                         ("bf16", BF16Config)):
        for f in fields(cls):
            for key in (json_key(f), *f.metadata.get("aliases", ())):
                if key != "enabled" and key not in top_level:
                    homes.setdefault(key, section)
    return homes


def load_config(config: ConfigInput) -> tuple[dict[str, Any], str]:
    """(raw dict, source) from a mapping or a JSON file path.

    Bad JSON reports the file, line and column; duplicate keys are errors
    (as in DeepSpeed).
    """
    if isinstance(config, Mapping):
        refuse_nonfinite(config, (), DICT_SOURCE)
        refuse_removed(config, Ctx(DICT_SOURCE))
        return dict(config), DICT_SOURCE
    if not isinstance(config, (str, os.PathLike)):
        raise DsrunConfigError(f"config must be a dict or a path to a JSON file, got "
                               f"{type(config).__name__}")
    path = os.fspath(config)
    try:
        # utf-8-sig: a BOM (Windows editors write one) is read, as DeepSpeed's hjson does
        with open(path, encoding="utf-8-sig") as handle:
            text = handle.read()
    except OSError as err:
        raise DsrunConfigError(f"cannot read config file {path}: {err.strerror}") from None

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise DsrunConfigError(f'duplicate key "{key}" in {path}')
            out[key] = value
        return out

    try:
        raw = json.loads(text, object_pairs_hook=no_duplicates, parse_float=_json_float)
    except json.JSONDecodeError as err:
        raise DsrunConfigError(f"{path}: line {err.lineno}, column {err.colno}: invalid JSON: "
                               f"{err.msg}{json_hint(path, text)}") from None
    if not isinstance(raw, dict):
        raise DsrunConfigError(f"{path} must hold a JSON object, got {show(raw)}")
    refuse_nonfinite(raw, (), path)
    # as DeepSpeed's DeepSpeedConfig, which zero.Init and checkpointing.configure
    # build too: every reader of a config refuses them, not only initialize()
    refuse_removed(raw, Ctx(path))
    return raw, path


class _Overflowed(float):
    """A JSON number too large for a float (``1e400``): infinite, with the
    text it was written as, for :func:`refuse_nonfinite`'s message."""

    text: str


def _json_float(text: str) -> float:
    value = float(text)
    if math.isfinite(value):
        return value
    out = _Overflowed(value)
    out.text = text
    return out


# keys where +inf is a setting: Accelerate's DeepSpeedPlugin always writes
# "steps_per_print": float("inf") for "never"
_INF_MEANS_NEVER = frozenset({("steps_per_print",)})


def refuse_nonfinite(value: Any, path: tuple[str, ...], source: str) -> None:
    """Raise naming the key path for an infinite or NaN number anywhere in
    ``value``: Python's JSON reader takes ``Infinity``/``NaN`` and reads
    ``1e400`` as inf (DeepSpeed's hjson refuses all three), and an inf lr,
    weight decay or loss scale trains NaNs or skips every step silently.
    Where the config sets nothing with a number (passthrough sections) it
    is refused too: no JSON file DeepSpeed reads holds one. The exception:
    ``steps_per_print`` (+inf: never print, as Accelerate writes it)."""
    if isinstance(value, float) and not math.isfinite(value) and \
            not (value == math.inf and path in _INF_MEANS_NEVER):
        if isinstance(value, _Overflowed):
            raise DsrunConfigError(
                f'"{".".join(path)}" in {source}: the number {value.text} overflowed (it is '
                f"beyond the largest float, about 1.8e308, and would be read as infinity); "
                f"write a finite number")
        raise DsrunConfigError(f'"{".".join(path)}" in {source} must be a finite number, got '
                               f"{show(value)}")
    if isinstance(value, Mapping):
        for key, item in value.items():
            refuse_nonfinite(item, (*path, str(key)), source)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            refuse_nonfinite(item, (*path, str(index)), source)


_NOT_JSON = re.compile(r"//|/\*|#|,\s*[}\]]")  # outside strings (json_hint)
_STRING = re.compile(r'"(?:[^"\\\n]|\\.)*"')


def json_hint(path: str, text: str) -> str:
    """What to add to a JSON error for a file that is not meant as JSON: a
    YAML file (which dsrun does not read), or the comments and trailing
    commas DeepSpeed's hjson reader takes and dsrun's strict JSON does not."""
    if path.lower().endswith((".yaml", ".yml")):
        return ("; dsrun reads config files as JSON only, not YAML: convert it "
                "(python -c 'import json,sys,yaml; json.dump(yaml.safe_load(open(sys.argv[1])), "
                "sys.stdout, indent=2)' FILE.yaml > FILE.json) or pass a dict to initialize()")
    # (JSON strings blanked first: "/data/*" or "a,]" inside one is not a comment)
    if path.lower().endswith(".hjson") or _NOT_JSON.search(_STRING.sub('""', text)):
        return ("; config files are strict JSON: no comments or trailing commas (DeepSpeed "
                "reads them as hjson, dsrun does not)")
    return ""


# Top-level keys of older configs (DeepSpeed's, Megatron's --fp32-allreduce)
# that no DeepSpeed release reads now, and the key that means the same.
REPLACED_KEYS: Mapping[str, str] = MappingProxyType({
    "fp32_allreduce": '"communication_data_type": "fp32"',
})


def _refuse_replaced(raw: Mapping[str, Any], ctx: Ctx) -> Mapping[str, Any]:
    """An unknown key that an older config meant something by: say what it
    is now, instead of listing every valid key; with ``allow_unknown_keys``
    it is ignored, with that warning. -> ``raw`` without those keys. Keys
    DeepSpeed 0.19.8 has removed are refused first (:func:`refuse_removed`)."""
    refuse_removed(raw, ctx)
    for key in REPLACED_KEYS.keys() & raw.keys():
        text = (f'unknown key "{key}" in {ctx.source}: what it asked for is now '
                f"{REPLACED_KEYS[key]} (it was {show(raw[key])}; DeepSpeed 0.19.8 ignores it "
                "silently)")
        if not ctx.allow_unknown:
            raise DsrunConfigError(text)
        log.warning("%s; ignoring it", text)
        ctx.ignored.append(key)
    return {k: v for k, v in raw.items() if k not in REPLACED_KEYS}


def _dotted_problem(parts: list[str], f: Any) -> str:
    """'' when the dotted path ``parts`` (``parts[0]`` names config field
    ``f``) names a real key, at the depth it goes to; else why not, with a
    did-you-mean for the wrong part. Free-form values (``optimizer.params``,
    a JSON-object setting) take any key."""
    for depth in range(1, len(parts)):
        here = ".".join(parts[:depth])
        if "section" not in f.metadata:
            kind = f.metadata["check"].kind if "check" in f.metadata else \
                "mapping" if f.default_factory is not MISSING else "value"  # optimizer.params
            return "" if kind in ("mapping", "json") else f'"{here}" takes a value, not keys'
        by_key = {key: g for g in fields(f.metadata["section"]) if not g.metadata.get("internal")
                  for key in (json_key(g), *g.metadata.get("aliases", ()))}
        if parts[depth] not in by_key:
            return (f'"{parts[depth]}" is no key of "{here}"'
                    + _dotted_hint(parts[depth], by_key, here))
        f = by_key[parts[depth]]
    return ""


def _dotted_hint(word: str, choices: Any, prefix: str) -> str:
    """'; did you mean "prefix.x"?' for the key of ``choices`` closest to
    ``word`` (:func:`did_you_mean`'s pick, given the whole path), else the
    valid keys."""
    hint = did_you_mean(word, choices)
    if hint:
        return hint.replace('"', f'"{prefix}.', 1)
    return f'; valid keys of "{prefix}": ' + ", ".join(sorted(choices))


def _drop_dotted(raw: Mapping[str, Any], ctx: Ctx, valid: Any) -> Mapping[str, Any]:
    """``raw`` without top-level keys such as ``"zero_optimization.reduce_bucket_size"``
    (a known section, a dot, a key of it): TRL's ``prepare_deepspeed`` adds
    them to the config it gives ``deepspeed.initialize``, and DeepSpeed 0.19.8
    reads no dotted key, so it ignores them silently. dsrun ignores them too,
    with one warning (they are listed in ``ignored_keys``). A dotted key whose
    path names no real key (``"zero_optimization.stgae"``) is an unknown key,
    as is one whose first part is not a known key (left to ``pick``)."""
    from dsrun.runtime.config import DsrunConfig  # config imports this module

    dotted = [k for k in raw if isinstance(k, str) and "." in k and k.split(".", 1)[0] in valid]
    if not dotted:
        return raw
    top = {json_key(f): f for f in fields(DsrunConfig)}
    real = []
    for key in dotted:
        parts = key.split(".")
        # a passthrough section is kept verbatim: dsrun checks none of its keys
        problem = "" if parts[0] in PASSTHROUGH_KEYS else \
            _dotted_problem(parts, top["bf16" if parts[0] == "bfloat16" else parts[0]])
        if not problem:
            real.append(key)
            continue
        text = f'unknown key "{key}" in {ctx.source}: {problem}'
        if not ctx.allow_unknown:
            raise DsrunConfigError(f'{text} (to only warn, set {{"dsrun": {{"allow_unknown_keys": '
                                   f"true}}}} or {ALLOW_UNKNOWN_ENV}=1)")
        log.warning("%s; ignoring it", text)
        ctx.ignored.append(key)
    if real:
        shown = ", ".join(f'"{k}" ({show(raw[k])})' for k in real)
        log.warning("%s: ignoring dotted top-level keys %s: DeepSpeed 0.19.8 ignores them too "
                    "(they set nothing; to set a value, put it inside its section)", ctx.source,
                    shown)
        ctx.ignored.extend(real)
    return {k: v for k, v in raw.items() if k not in dotted}


def _allow_unknown(raw: Mapping[str, Any], environ: Mapping[str, str]) -> bool:
    section = raw.get("dsrun")
    if isinstance(section, Mapping) and section.get("allow_unknown_keys") is True:
        return True
    return environ.get(ALLOW_UNKNOWN_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _without_auto_enabled(raw: Any) -> Any:
    if isinstance(raw, Mapping) and is_auto(raw.get("enabled")):
        return {**raw, "enabled": False}
    return raw


def _switched_on(key: str, value: Any) -> bool:
    """Whether passthrough section ``key`` asks DeepSpeed to do anything:
    sections without an ``enabled`` key are on by their own switch, the
    others by ``enabled`` (false by default; an empty section is off)."""
    if value is None or value is False or key in PARALLEL_SIZE_KEYS:
        return False  # the sizes: 1, or data_parallel_size equal to the engine's (checked)
    if not isinstance(value, Mapping):
        return True
    if key == "datastates_ckpt":
        return True  # DeepSpeed: on unless the value is false
    if key == "compile":  # the engine's compile() is separate; the section tunes DeepCompile
        return value.get("deepcompile") is True
    if key == "tensor_parallel":  # DeepSpeed's AutoTP training: autotp_size 0 (default) is off
        size = value.get("autotp_size", 0)
        return not isinstance(size, (int, float)) or isinstance(size, bool) or size > 1
    if value.get("enabled") is False or is_auto(value.get("enabled")):
        return False
    if key == "weight_quantization":  # DeepSpeed acts on these two subsections only
        return bool(value.get("quantized_initialization") or value.get("post_init_quant"))
    return bool(value)


def _passthrough(known: Mapping[str, Any], ctx: Ctx) -> dict[str, Any]:
    kept = {k: check_section(k, v, ctx) for k, v in known.items() if k in PASSTHROUGH_KEYS}
    check_parallel_sizes(kept, ctx)
    # "aio" tunes DeepSpeed's NVMe offload I/O, which dsrun does not have (an nvme
    # offload device is refused by name): Lightning writes it into every config
    active = sorted(k for k, v in kept.items() if k != "aio" and _switched_on(k, v))
    if active:
        log.warning("%s: dsrun accepts but does not implement: %s", ctx.source, ", ".join(active))
    return kept


# Top-level keys dsrun parses and checks but whose non-default values it
# does not act on, with their defaults (one warning names those that are set).
# (DeepSpeed 0.19.8's removed sparse_gradients and graph_harvesting are refused
# before parsing: config_passthrough.REMOVED_KEYS)
INERT_KEYS: Mapping[str, Any] = MappingProxyType({
    "disable_allgather": False, "vocabulary_size": None,
    "seq_parallel_communication_data_type": "fp32"})


def inert_settings(config: DsrunConfig) -> list[str]:
    """What in ``config`` is accepted but has no effect in dsrun: keys of
    :data:`INERT_KEYS` set to another value than their default, and
    ``gradient_predivide_factor`` with a ZeRO stage (ZeRO divides every
    gradient by the data-parallel size before reducing it)."""
    notes = [key for key, default in INERT_KEYS.items()
             if getattr(config, key) != default]
    pipe = config.pipeline
    unapplied = [key for key, default in (("stages", "auto"), ("partition", "best"),
                                          ("seed_layers", False))
                 if getattr(pipe, key) != default]
    if unapplied:
        notes.append(f"pipeline.{'/'.join(unapplied)} (as in DeepSpeed: pass num_stages=, "
                     "partition_method=, seed_layers= to PipelineModule)")
    if not (pipe.pipe_partitioned and pipe.grad_partitioned):
        notes.append("pipeline.pipe_partitioned/grad_partitioned (they only matter with tensor "
                     "parallelism)")
    accum = config.data_types.grad_accum_dtype
    trained = "float16" if config.precision == "fp16" else "float32"
    if accum is not None and DTYPE_NAMES[accum] != trained:
        zero_sums = "; ZeRO 2-3 sum reduced micro-steps in float32 with float16's overflow " \
            "rule" if trained == "float16" else ""
        notes.append(f"data_types.grad_accum_dtype {accum!r} (dsrun accumulates gradients in "
                     f"the trained parameters' dtype, {trained} here{zero_sums})")
    if config.precision == "fp32" and (config.data_types.buffer_dtype is not None or
                                       config.data_types.keep_in_fp32_modules != KEEP_IN_FP32_AUTO):
        notes.append("data_types.buffer_dtype/keep_in_fp32_modules without fp16 or bf16 (as in "
                     "DeepSpeed, they apply only to fp16/bf16 training)")
    if config.gradient_predivide_factor != 1.0 and config.zero_optimization.stage > 0:
        notes.append("gradient_predivide_factor (ZeRO stages divide gradients by the "
                     "data-parallel size before reducing them)")
    return notes
