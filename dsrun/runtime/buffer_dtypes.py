"""The dtype of a model's floating buffers under fp16 and bf16 training, as
DeepSpeed 0.19.8 sets it (``data_types.buffer_dtype`` and
``data_types.keep_in_fp32_modules``; its ``runtime/keep_in_fp32.py``).

**At initialize()** (:func:`apply_buffer_rules`, every ZeRO stage, models
built under ``zero.Init`` included): training in fp16 or bf16 casts the
*parameters* only; a floating buffer keeps the dtype the model holds it in
(an fp32 rotary ``inv_freq`` or MoE routing bias stays fp32), unless
``buffer_dtype`` is set: then it is cast to that dtype. The buffers
``keep_in_fp32_modules`` names are kept in fp32 either way (and upcast when
they arrive in 16 bits). Under fp32 training nothing is cast, as in
DeepSpeed.

**Names kept in fp32** (:func:`keep_pattern`): ``"auto"`` (the default) is
the model's own Hugging Face lists - the class attributes
``_keep_in_fp32_modules_strict`` (under bf16 and fp16) and
``_keep_in_fp32_modules`` (under fp16 only) of the model and of its
submodules, a submodule's names prefixed with its own; a list gives name
patterns (``*`` is any characters; a pattern matches anywhere in the full
buffer name, as transformers matches them); ``[]`` keeps nothing.

**Under zero.Init** (:class:`ConstructorTags`, :func:`cast_new_buffers`):
DeepSpeed's ``zero.Init`` makes the floating tensors that ``torch.tensor``,
``empty``, ``zeros``, ``ones``, ``full``, ``arange``, ``eye`` and ``randn``
create inside it in the Init dtype, so a buffer made by one of them is
16-bit while one computed another way (``inv_freq`` from an integer
``arange(...).float()``) stays fp32. dsrun notes which tensors those
constructors made (without changing them) and, when a model's construction
is complete (the outermost module built in the context returns from its
``__init__``), casts the buffers among them to the Init dtype - except the
ones the model names for fp32, which are thus never rounded (DeepSpeed
rounds them, then upcasts them). dsrun goes by the tensor object, so two
rare cases differ: a constructor's fp32 tensor passed through a no-op
``.float()`` is cast (DeepSpeed's ``.float()`` of its 16-bit tensor is a
new fp32 one), and arithmetic on a constructor's tensor (``torch.ones(n) *
2``) stays fp32 (16-bit in DeepSpeed).
"""

from __future__ import annotations

import logging
import re
import weakref
from collections.abc import Iterator
from typing import Any, Callable, Optional

import torch

from dsrun.runtime.config import DTYPE_NAMES, DsrunConfig
from dsrun.runtime.config_sections import KEEP_IN_FP32_AUTO

log = logging.getLogger("dsrun.runtime.engine")

HALF_DTYPES = (torch.float16, torch.bfloat16)
# the floating dtypes DeepSpeed casts (float8 and complex buffers are left alone)
CASTABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def training_dtype(config: DsrunConfig) -> Optional[torch.dtype]:
    """The 16-bit dtype fp16 or bf16 trains in; None under fp32."""
    return {"fp16": torch.float16, "bf16": torch.bfloat16}.get(config.precision)


def keep_pattern(module: torch.nn.Module, setting: Any, dtype: Optional[torch.dtype]
                 ) -> Optional[re.Pattern[str]]:
    """The pattern of the buffer names of ``module`` kept in fp32 when it
    trains in ``dtype``; None when there are none (module docstring)."""
    if dtype not in HALF_DTYPES:
        return None
    if setting is None or setting == KEEP_IN_FP32_AUTO:
        patterns = set()
        for prefix, child in module.named_modules():
            names = set(getattr(child, "_keep_in_fp32_modules_strict", None) or ())
            if dtype == torch.float16:
                names |= set(getattr(child, "_keep_in_fp32_modules", None) or ())
            for name in names:
                pattern = name.replace("*", ".*")
                patterns.add(rf"^{re.escape(prefix)}\..*{pattern}" if prefix else pattern)
    else:
        patterns = {name.replace("*", ".*") for name in setting}
    return re.compile("|".join(sorted(patterns))) if patterns else None


def _named_buffers(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every floating buffer of ``module`` once, with its full name."""
    seen: set[int] = set()
    for prefix, owner in module.named_modules():
        for name, buf in owner.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point() and id(buf) not in seen:
                seen.add(id(buf))
                yield (f"{prefix}.{name}" if prefix else name), buf


def kept_buffers(module: torch.nn.Module, pattern: Optional[re.Pattern[str]]
                 ) -> list[torch.Tensor]:
    """The floating buffers of ``module`` whose full names ``pattern`` finds."""
    if pattern is None:
        return []
    return [buf for name, buf in _named_buffers(module) if pattern.search(name)]


@torch.no_grad()
def _cast(buffers: list[torch.Tensor], dtype: torch.dtype) -> int:
    """Cast ``buffers`` (in place: the module keeps the same objects) to ``dtype``."""
    changed = 0
    for buf in buffers:
        if buf.dtype in CASTABLE and buf.dtype != dtype:
            buf.data = buf.data.to(dtype)
            changed += 1
    return changed


def apply_buffer_rules(module: torch.nn.Module, config: DsrunConfig) -> None:
    """At initialize(): fp32 for the buffers ``keep_in_fp32_modules`` names,
    ``buffer_dtype`` (where set) for the others (module docstring)."""
    dtype = training_dtype(config)
    if dtype is None:
        return
    types = config.data_types
    kept = kept_buffers(module, keep_pattern(module, types.keep_in_fp32_modules, dtype))
    upcast = _cast(kept, torch.float32)
    cast = 0
    if types.buffer_dtype is not None:
        held = {id(b) for b in kept}
        cast = _cast([b for _, b in _named_buffers(module) if id(b) not in held],
                     getattr(torch, DTYPE_NAMES[types.buffer_dtype]))
    if kept or cast:
        log.info("%s: %d buffer(s) kept in fp32 (data_types.keep_in_fp32_modules; %d upcast), "
                 "%d cast to data_types.buffer_dtype %s", config.precision, len(kept), upcast,
                 cast, types.buffer_dtype)


# ----------------------------------------------------------------- zero.Init

# DeepSpeed's zero.Init makes the floating tensors these create in its dtype
CONSTRUCTORS = ("tensor", "empty", "zeros", "ones", "full", "arange", "eye", "randn")


class ConstructorTags:
    """While installed (:meth:`install` / :meth:`remove`, by the outermost
    ``zero.Init`` context), remembers the floating tensors that
    :data:`CONSTRUCTORS` return, by identity and weakly."""

    def __init__(self) -> None:
        self._tags: dict[int, weakref.ref[torch.Tensor]] = {}
        self._originals: dict[str, Callable[..., Any]] = {}

    def install(self) -> None:
        for name in CONSTRUCTORS:
            original = getattr(torch, name)
            self._originals[name] = original
            setattr(torch, name, self._tagging(original))

    def remove(self) -> None:
        for name, original in self._originals.items():
            setattr(torch, name, original)
        self._originals.clear()
        self._tags.clear()

    def _tagging(self, original: Callable[..., Any]) -> Callable[..., Any]:
        tags = self._tags

        def make(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            if isinstance(out, torch.Tensor) and out.is_floating_point():
                key = id(out)
                # the entry goes with the tensor, before its id can be reused
                tags[key] = weakref.ref(out, lambda _, key=key: tags.pop(key, None))
            return out

        make.__wrapped__ = original  # type: ignore[attr-defined]
        make.__name__ = getattr(original, "__name__", "constructor")
        return make

    def take(self, tensor: torch.Tensor) -> bool:
        """Whether a constructor made ``tensor``; forgets it."""
        ref = self._tags.get(id(tensor))
        if ref is None or ref() is not tensor:
            return False
        del self._tags[id(tensor)]
        return True


def cast_new_buffers(module: torch.nn.Module, tags: ConstructorTags,
                     dtype: Optional[torch.dtype], setting: Any) -> None:
    """A model built under ``zero.Init`` in ``dtype``: its buffers made by the
    constructors go to ``dtype``, except the ones ``setting`` keeps in fp32,
    which are upcast where they are 16-bit (module docstring)."""
    kept = kept_buffers(module, keep_pattern(module, setting, dtype))
    held = {id(b) for b in kept}
    # every buffer's tag is taken: one kept here is not cast by an enclosing model later
    made = [b for _, b in _named_buffers(module) if tags.take(b)]
    _cast(kept, torch.float32)
    if dtype is not None:
        _cast([b for b in made if id(b) not in held], dtype)
