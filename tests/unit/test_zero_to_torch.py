"""``zero_to_torch``: DeepSpeed 0.19.8's second recovery script, on dsrun checkpoints.

A save leaves ``zero_to_fp32.py`` and ``zero_to_torch.py`` in the save
directory, both executable (DeepSpeed's copies are: ``./SAVE_DIR/zero_to_
fp32.py`` must not say "Permission denied"); ``zero_to_torch`` takes
DeepSpeed's command line (``--dtype`` required, one of its six names) and
writes the weights in that dtype; ``deepspeed.utils.zero_to_torch`` imports
under ``import dsrun as deepspeed``. One rank, in this process.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import dsrun
from dsrun.utils.zero_to_torch import main

SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 5)
        self.register_buffer("count", torch.tensor(3, dtype=torch.long))


@pytest.fixture
def saved(solo: None, tmp_path: Path) -> tuple[dict[str, torch.Tensor], Path]:
    torch.manual_seed(0)
    engine, *_ = dsrun.initialize(model=Model(), config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "Adam", "params": {"lr": 0.1}}})
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    engine.destroy()
    return state, tmp_path / "ckpt"


def run_script(path: Path, *argv: Any) -> subprocess.CompletedProcess[str]:
    """``path`` run as a program (its shebang: the python first on PATH)."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return subprocess.run([str(path), *map(str, argv)], capture_output=True, text=True,
                          env=env, timeout=120)


def test_both_scripts_are_there_executable_and_run(saved: tuple[dict[str, Any], Path],
                                                  tmp_path: Path) -> None:
    state, root = saved
    for name in SCRIPTS:
        assert (root / name).stat().st_mode & stat.S_IXUSR, name
    res = run_script(root / "zero_to_torch.py", root, tmp_path / "bf16", "--dtype", "bf16")
    assert res.returncode == 0, res.stderr
    written = torch.load(tmp_path / "bf16" / "pytorch_model.bin")
    assert written["a.weight"].dtype == torch.bfloat16
    assert torch.equal(written["a.weight"], state["a.weight"].to(torch.bfloat16))
    assert written["count"].dtype == torch.long and int(written["count"]) == 3
    res = run_script(root / "zero_to_fp32.py", root, tmp_path / "fp32")
    assert res.returncode == 0, res.stderr
    assert torch.equal(torch.load(tmp_path / "fp32" / "pytorch_model.bin")["a.bias"],
                       state["a.bias"])


@pytest.mark.parametrize("dtype, want", [("float16", torch.float16), ("fp32", torch.float32)])
def test_deepspeeds_command_line(dtype: str, want: torch.dtype, tmp_path: Path,
                                 saved: tuple[dict[str, Any], Path]) -> None:
    state, root = saved
    tag = (root / "latest").read_text()
    assert main([str(root), str(tmp_path / "out"), "--dtype", dtype, "-t", tag,
                 "--safe_serialization", "--max_shard_size", "10MB"]) == 0
    from safetensors.torch import load_file

    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert written["a.weight"].dtype == want
    assert torch.equal(written["a.weight"], state["a.weight"].to(want))


def test_dtype_is_required_and_one_of_deepspeeds_names(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    for argv in ([str(tmp_path), str(tmp_path / "o")],
                 [str(tmp_path), str(tmp_path / "o"), "--dtype", "int8"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--dtype" in err and "{bf16,bfloat16,float16,float32,fp16,fp32}" in err


def test_an_error_is_one_line_and_exit_status_1(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "nowhere"), str(tmp_path / "o"), "--dtype", "bf16"]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_deepspeed_utils_zero_to_torch_imports_under_the_alias() -> None:
    code = ("import dsrun as deepspeed\n"
            "from deepspeed.utils.zero_to_torch import convert_zero_checkpoint_to_state_dict\n"
            "from deepspeed.utils.zero_to_torch import main\n"
            "import deepspeed.utils.zero_to_torch as m\n"
            "print(m.__name__, main.__module__)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["dsrun.utils.zero_to_torch", "dsrun.utils.zero_to_torch"]
