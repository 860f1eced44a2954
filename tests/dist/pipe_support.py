"""The pipeline case definitions of workers/pipe_cases.py, importable by tests
(the worker runs as a script under dsrun; tests load the same file)."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from tests.conftest import ROOT

WORKER = ROOT / "tests" / "dist" / "workers" / "pipe_cases.py"


def load_cases() -> ModuleType:
    if "pipe_cases" in sys.modules:
        return sys.modules["pipe_cases"]
    spec = importlib.util.spec_from_file_location("pipe_cases", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["pipe_cases"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module
