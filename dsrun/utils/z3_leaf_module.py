"""ZeRO stage 3 leaf modules: DeepSpeed's ``deepspeed.utils.z3_leaf_module``.

A **leaf module** is fetched as one unit: stage 3 hooks the leaf itself but
nothing inside it, gathers every parameter of its subtree when its forward
starts (and again before its backward), and reduces the gradients of all of
them together when the backward pass ends - zeros for the parameters this
rank's pass did not use. A mixture-of-experts block whose ranks route their
tokens to different experts is the case it is made for: without it, each
rank gathers and reduces the experts it ran, and the ranks' collectives
differ (dsrun reports that divergence; DeepSpeed hangs).

Mark leaves before ``deepspeed.initialize`` builds the stage-3 engine (it
decides which modules it hooks once, as DeepSpeed does), by class
(:func:`set_z3_leaf_modules`), by name in ``named_modules()``
(:func:`set_z3_leaf_modules_by_name`), by name suffix
(:func:`set_z3_leaf_modules_by_suffix`), or with the config's
``zero_optimization.leaf_module`` section (:func:`apply_zero_leaf_module_config`;
by default DeepSpeed's list of Hugging Face sparse-MoE block classes).

The flag is the module attribute ``_z3_leaf``, as in DeepSpeed. Which
parameters belong to a hooked leaf (:func:`z3_leaf_parameter`) is kept in a
process-wide table keyed by parameter identity, not on the parameter (an
attribute holding a module would follow the parameter into copies and
pickles); entries go away with the parameters.

``dsrun.utils.z3_leaf_module`` names both this module and the function (in
DeepSpeed the package's import of the function hides the submodule; here
importing the submodule binds it over the package's name), so the module
object is callable: calling it calls :func:`z3_leaf_module`.
"""

from __future__ import annotations

import logging
import sys
import types
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional, Union

import torch
from torch.utils.weak import WeakIdKeyDictionary

log = logging.getLogger("dsrun.runtime.zero")

LEAF_ATTR = "_z3_leaf"
# DeepSpeed 0.19's leaf_module.classes default: Hugging Face sparse-MoE blocks
DEFAULT_LEAF_MODULE_CLASSES: tuple[str, ...] = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)
LEAF_CONFIG_KEYS = ("classes", "names", "name_suffixes")

ClassSpec = Union[type, str]
_LEAF_OF: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> ref to its hooked leaf


def z3_leaf_module(model: torch.nn.Module) -> bool:
    """True when ``model`` is flagged as a leaf module."""
    return bool(getattr(model, LEAF_ATTR, False))


def z3_leaf_parameter(param: torch.Tensor) -> bool:
    """True when ``param`` belongs to a leaf module that a stage-3 engine hooked."""
    ref = _LEAF_OF.get(param)
    return ref is not None and ref() is not None


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` flagged as leaves (``model.modules()`` order)."""
    return [module for module in model.modules() if z3_leaf_module(module)]


def set_z3_leaf_module(model: torch.nn.Module, flag: bool) -> None:
    """Flag (or unflag) ``model`` itself."""
    setattr(model, LEAF_ATTR, bool(flag))


def mark_leaf_parameters(leaf: torch.nn.Module) -> None:
    """Record that the parameters of ``leaf``'s subtree belong to a hooked leaf."""
    ref = weakref.ref(leaf)
    for param in leaf.parameters():
        _LEAF_OF[param] = ref


def unmark_leaf_parameters(leaf: torch.nn.Module) -> None:
    for param in leaf.parameters():
        ref = _LEAF_OF.get(param)
        if ref is not None and ref() is leaf:
            del _LEAF_OF[param]


def _qualified(module: torch.nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _matches(module: torch.nn.Module, spec: ClassSpec) -> bool:
    if isinstance(spec, type):
        return isinstance(module, spec)
    return type(module).__name__ == spec or _qualified(module) == spec


def _set_by_class(model: torch.nn.Module, classes: Sequence[ClassSpec], flag: bool,
                  raise_if_not_found: bool) -> list[torch.nn.Module]:
    classes = list(classes) if not isinstance(classes, (type, str)) else [classes]
    bad = [c for c in classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"leaf_module_classes must be classes or class names, got {bad!r}")
    found = [m for m in model.modules() if any(_matches(m, c) for c in classes)]
    for module in found:
        set_z3_leaf_module(module, flag)
    if not found and raise_if_not_found:
        names = [c if isinstance(c, str) else c.__name__ for c in classes]
        raise ValueError(f"no module of class {names} in the model "
                         f"({type(model).__name__})")
    return found


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: Sequence[ClassSpec],
                        raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    """Flag every module of ``model`` that is an instance of one of
    ``leaf_module_classes`` (classes, class names or fully qualified class
    names) as a leaf (module docstring). Returns the flagged modules; raises
    ``ValueError`` when there is none (unless ``raise_if_not_found`` is False)."""
    return _set_by_class(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes: Sequence[ClassSpec],
                          raise_if_not_found: bool = True) -> list[torch.nn.Module]:
    """Clear the leaf flag of the modules :func:`set_z3_leaf_modules` would flag."""
    return _set_by_class(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(model: torch.nn.Module, module_names: Iterable[str],
                                flag: bool = True, raise_if_not_found: bool = True
                                ) -> tuple[list[torch.nn.Module], list[str]]:
    """Flag the modules named ``module_names`` (``named_modules()`` names).
    Returns (modules, names that matched none)."""
    by_name = dict(model.named_modules())
    found, missing = [], []
    for name in module_names:
        module = by_name.get(name)
        if module is None:
            missing.append(name)
            continue
        set_z3_leaf_module(module, flag)
        found.append(module)
    if missing and raise_if_not_found:
        raise ValueError(f"no module named {missing} in the model ({type(model).__name__})")
    return found, missing


def set_z3_leaf_modules_by_suffix(model: torch.nn.Module, module_name_suffixes: Iterable[str],
                                  flag: bool = True, raise_if_not_found: bool = True
                                  ) -> tuple[list[torch.nn.Module], list[str]]:
    """Flag the modules whose ``named_modules()`` name ends with one of
    ``module_name_suffixes``. Returns (modules, suffixes that matched none)."""
    by_name = dict(model.named_modules())
    found: dict[int, torch.nn.Module] = {}
    missing = []
    for suffix in module_name_suffixes:
        hits = [m for name, m in by_name.items() if name.endswith(suffix)]
        for module in hits:
            set_z3_leaf_module(module, flag)
            found.setdefault(id(module), module)
        if not hits:
            missing.append(suffix)
    if missing and raise_if_not_found:
        raise ValueError(f"no module name ends with {missing} in the model "
                         f"({type(model).__name__})")
    return list(found.values()), missing


def leaf_config_lists(section: Optional[Mapping[str, Any]]) -> dict[str, tuple[str, ...]]:
    """``zero_optimization.leaf_module`` as lists (DeepSpeed's defaults for
    absent keys; a single string is a list of one)."""
    out = {"classes": DEFAULT_LEAF_MODULE_CLASSES, "names": (), "name_suffixes": ()}
    for key, value in (section or {}).items():
        out[key] = (value,) if isinstance(value, str) else tuple(dict.fromkeys(map(str, value)))
    return out


def apply_zero_leaf_module_config(model: torch.nn.Module,
                                  leaf_cfg: Optional[Mapping[str, Any]]
                                  ) -> list[torch.nn.Module]:
    """Flag the leaves a ``zero_optimization.leaf_module`` section names
    (``None``: nothing at all, as DeepSpeed). Entries that match nothing are
    logged when the user set them (DeepSpeed's default classes are simply
    absent from most models). Returns the flagged modules, each once."""
    if leaf_cfg is None:
        return []
    lists = leaf_config_lists(leaf_cfg)
    found: dict[int, torch.nn.Module] = {}
    for module in _set_by_class(model, lists["classes"], True, raise_if_not_found=False):
        found.setdefault(id(module), module)
    named, missing = set_z3_leaf_modules_by_name(model, lists["names"],
                                                 raise_if_not_found=False)
    by_suffix, unmatched = set_z3_leaf_modules_by_suffix(model, lists["name_suffixes"],
                                                         raise_if_not_found=False)
    for module in [*named, *by_suffix]:
        found.setdefault(id(module), module)
    if missing:
        log.warning("zero_optimization.leaf_module.names: no module named %s", missing)
    if unmatched:
        log.warning("zero_optimization.leaf_module.name_suffixes: no module name ends with %s",
                    unmatched)
    customized = "names" in leaf_cfg or "name_suffixes" in leaf_cfg or (
        "classes" in leaf_cfg and lists["classes"] != DEFAULT_LEAF_MODULE_CLASSES)
    if not found and customized:
        log.warning("zero_optimization.leaf_module matched no module: ZeRO-3 hooks every "
                    "module as usual")
    return list(found.values())


class _CallableModule(types.ModuleType):
    """This module, callable as :func:`z3_leaf_module` (module docstring)."""

    def __call__(self, model: torch.nn.Module) -> bool:
        return z3_leaf_module(model)


sys.modules[__name__].__class__ = _CallableModule
