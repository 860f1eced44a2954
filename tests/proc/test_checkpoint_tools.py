"""The offline checkpoint tools as a user runs them: ``dsrun checkpoint
to-fp32`` streaming a model of several hundred MB with its peak memory
measured, and ``dsrun checkpoint info`` without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dsrun.runtime.checkpoint.coord import Coordinator
from dsrun.runtime.checkpoint.sources import ModuleTensors
from dsrun.runtime.checkpoint.writer import SaveRequest, save_state
from tests.conftest import ROOT, run_dsrun

pytestmark = pytest.mark.proc

MiB = 2**20
FIXED_OVERHEAD = 64 * MiB  # zip bookkeeping, allocator slack, the page of a pickle


def big_model() -> torch.nn.Module:
    """320 MiB of fp32: a 64 MiB embedding and sixteen 16 MiB matrices."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(16384, 1024)
    model.layers = torch.nn.ModuleList(torch.nn.Linear(2048, 2048, bias=False)
                                       for _ in range(16))
    return model


def save_module(module: torch.nn.Module, root: Path) -> None:
    source = ModuleTensors(module, [], (0, 1))
    save_state(SaveRequest(str(root), "t", meta={"zero_stage": 0}),
               [source.export_state({})], Coordinator(60))


# The peak resident set of this process image: VmHWM (ru_maxrss would carry
# the parent's high-water mark over the fork).
MEASURE = """
import json, sys
import torch
from dsrun.runtime.checkpoint.consolidate import to_fp32

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024

base = hwm()
done = to_fp32(sys.argv[1], sys.argv[2])
print(json.dumps({"base": base, "peak": hwm(), "largest": done.largest_bytes,
                  "total": done.bytes}))
"""


def test_to_fp32_streams_a_large_model_within_twice_its_largest_tensor(tmp_path: Path) -> None:
    model = big_model()
    save_module(model, tmp_path / "ckpt")
    out = tmp_path / "model.pt"
    res = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path / "ckpt"), str(out)],
                         capture_output=True, text=True, timeout=240, cwd=str(ROOT))
    assert res.returncode == 0, res.stderr[-3000:]
    m = json.loads(res.stdout.strip().splitlines()[-1])
    assert m["total"] == 320 * MiB and m["largest"] == 64 * MiB
    grown = m["peak"] - m["base"]
    assert grown < 2 * m["largest"] + FIXED_OVERHEAD, \
        f"peak grew by {grown / MiB:.0f} MiB for a {m['largest'] / MiB:.0f} MiB largest tensor"
    loaded = torch.load(out, mmap=True)
    assert list(loaded) == list(model.state_dict())
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


def test_cli_info_and_to_fp32(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    save_module(model, tmp_path / "ckpt")
    res = run_dsrun("checkpoint", "info", str(tmp_path / "ckpt"))
    assert res.returncode == 0, res.stderr
    assert "tags: t (latest)" in res.stdout and "parameters: 26 in 4 tensors" in res.stdout
    res = run_dsrun("checkpoint", "info", "--json", str(tmp_path / "ckpt"))
    assert json.loads(res.stdout)["selected"]["parameters"] == 26
    res = run_dsrun("checkpoint", "to-fp32", str(tmp_path / "ckpt"), str(tmp_path / "o.pt"))
    assert res.returncode == 0 and "wrote" in res.stdout and "4 tensors" in res.stdout
    state = torch.load(tmp_path / "o.pt")
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    fresh.load_state_dict(state)  # strict: every key, right shapes
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
    res = run_dsrun("checkpoint", "to-fp32", "--tag", "nope", str(tmp_path / "ckpt"),
                    str(tmp_path / "x.pt"))
    assert res.returncode == 1
    assert res.stderr.startswith("dsrun: error: cannot load tag 'nope'")
    res = run_dsrun("checkpoint", "info", str(tmp_path / "missing"))
    assert res.returncode == 1 and "does not exist" in res.stderr


def test_cli_info_imports_no_torch(tmp_path: Path) -> None:
    save_module(torch.nn.Linear(2, 2), tmp_path / "ckpt")
    code = ("import sys; from dsrun.launcher import cli; "
            f"rc = cli.main(['checkpoint', 'info', {str(tmp_path / 'ckpt')!r}]); "
            "print('TORCH', 'torch' in sys.modules, rc)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=str(ROOT))
    assert "TORCH False 0" in res.stdout, res.stderr
