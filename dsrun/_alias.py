"""``deepspeed`` as an import name for dsrun, where DeepSpeed is not installed.

DeepSpeed scripts ported with ``import dsrun as deepspeed`` keep lines such
as ``from deepspeed.pipe import PipelineModule, LayerSpec``: an import
statement looks the dotted name up in the import system, where the local
alias ``deepspeed`` does not exist. :func:`install` (run by ``import
dsrun``) adds a finder that answers ``deepspeed`` and ``deepspeed.<name>``
with the modules ``dsrun`` and ``dsrun.<name>`` themselves - the same
objects, not copies - but only while no real ``deepspeed`` package is on
``sys.path`` (then the finder stays out of the way, and ``import deepspeed``
gets DeepSpeed). The alias has no distribution metadata, so tools that ask
``importlib.metadata`` whether DeepSpeed is installed still hear no.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Optional

ALIAS = "deepspeed"
TARGET = "dsrun"
# DeepSpeed module paths whose dsrun module has another name.
RENAMED = {
    "deepspeed.runtime.zero.partition_parameters": "dsrun.zero",  # Init, GatheredParameters...
    "deepspeed.runtime.activation_checkpointing.checkpointing": "dsrun.checkpointing",
}


def target_name(fullname: str) -> str:
    """The dsrun module that answers the DeepSpeed module name ``fullname``."""
    return RENAMED.get(fullname) or TARGET + fullname[len(ALIAS):]


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname == ALIAS:
            if importlib.machinery.PathFinder.find_spec(ALIAS) is not None:
                return None  # the real DeepSpeed is installed: leave it alone
        elif not fullname.startswith(ALIAS + ".") or \
                sys.modules.get(ALIAS) is not sys.modules.get(TARGET):
            return None
        name = target_name(fullname)
        if importlib.util.find_spec(name) is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=fullname == ALIAS)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(target_name(spec.name))
        self._spec = getattr(module, "__spec__", None)
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system stamped the alias spec on the real module: undo it
        module.__spec__ = self._spec


_FINDER = _Finder()


def install() -> None:
    """Add the finder first in ``sys.meta_path`` (once)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
