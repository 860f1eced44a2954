"""``deepspeed`` as an import name for dsrun, where DeepSpeed is not installed.

DeepSpeed scripts ported with ``import dsrun as deepspeed`` keep lines such
as ``from deepspeed.pipe import PipelineModule, LayerSpec``: an import
statement looks the dotted name up in the import system, where the local
alias ``deepspeed`` does not exist. :func:`install` (run by ``import
dsrun``) adds a finder that answers ``deepspeed`` and ``deepspeed.<name>``
with the modules ``dsrun`` and ``dsrun.<name>`` themselves - the same
objects, not copies - but only while no real ``deepspeed`` package is on
``sys.path`` (then the finder stays out of the way, and ``import deepspeed``
gets DeepSpeed).

The same finder answers ``importlib.metadata`` for the distribution
``deepspeed`` under the same condition, with version
``0.19.8+dsrun.<dsrun's version>`` (the DeepSpeed release whose API dsrun
follows): Hugging Face's Trainer and Accelerate check the metadata before
they use DeepSpeed, and so run on dsrun. It answers queries of the default
search path only (not a listing of given directories, as pip makes), and
``DSRUN_DEEPSPEED_METADATA=0`` turns it off.
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
import os
import pathlib
import re
import sys
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any, Optional

ALIAS = "deepspeed"
TARGET = "dsrun"
#: the DeepSpeed release whose API dsrun follows (the metadata's version)
DEEPSPEED_API_VERSION = "0.19.8"
METADATA_SWITCH = "DSRUN_DEEPSPEED_METADATA"
# DeepSpeed module paths whose dsrun module has another name.
RENAMED = {
    "deepspeed.runtime.zero.partition_parameters": "dsrun.zero",  # Init, GatheredParameters...
    "deepspeed.runtime.activation_checkpointing.checkpointing": "dsrun.checkpointing",
}


def target_name(fullname: str) -> str:
    """The dsrun module that answers the DeepSpeed module name ``fullname``."""
    return RENAMED.get(fullname) or TARGET + fullname[len(ALIAS):]


def _deepspeed_installed() -> bool:
    return importlib.machinery.PathFinder.find_spec(ALIAS) is not None


@functools.cache
def _alias_distribution() -> Any:
    """The metadata of the ``deepspeed`` alias (module docstring). Made on
    first use: importlib.metadata (and importlib.abc) import some 25 stdlib
    modules, among them random, socket and tempfile, which ``import dsrun``
    in a rank or node agent would otherwise import before either can take
    the user's working directory off sys.path (dsrun/safepath.py)."""
    import importlib.metadata

    class AliasDistribution(importlib.metadata.Distribution):
        def read_text(self, filename: str) -> Optional[str]:
            if filename == "METADATA":
                from dsrun import __version__

                return (f"Metadata-Version: 2.1\nName: {ALIAS}\n"
                        f"Version: {__version__}\n"
                        f"Summary: dsrun answering for DeepSpeed (import dsrun as deepspeed)\n")
            if filename == "top_level.txt":
                return ALIAS + "\n"
            return None

        def locate_file(self, path: Any) -> pathlib.Path:
            return pathlib.Path(__file__).parent / str(path)

    return AliasDistribution()


class _Finder:
    """A meta-path finder and loader (the importlib.abc protocols, not its
    classes: see _alias_distribution)."""

    def find_distributions(self, context: Any = None
                           ) -> Iterator[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is not None and re.sub(r"[-_.]+", "-", name).lower() != ALIAS:
            return iter(())
        if "path" in getattr(context, "__dict__", {}) or os.environ.get(METADATA_SWITCH) == "0" \
                or _deepspeed_installed():
            return iter(())  # directories were named, turned off, or the real one is there
        return iter((_alias_distribution(),))

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname == ALIAS:
            if _deepspeed_installed():
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
