"""``zero.Init`` without a process group starts one, as DeepSpeed's does
(``init_distributed()`` when none exists): the rank comes from the
environment - none under plain python (world size 1), torchrun's variables
under torchrun - and a group that cannot be started is one clear error.
Each case is a fresh python process, so no group exists when it begins."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.dist.test_engine_dist import LAUNCHER_VARS

pytestmark = pytest.mark.dist

SCRIPT = """
import sys, torch, torch.distributed as dist, dsrun
assert not dist.is_initialized()
with dsrun.zero.Init(config_dict_or_path={"zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}}):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))
weight, bias = model[0].weight, model[1].bias
assert dist.is_initialized()
facts = [dist.get_rank(), dist.get_world_size(), weight.ds_numel, weight.ds_tensor.numel()]
# DeepSpeed's per-parameter queries (Lightning's model summary asks them)
facts += [weight.partition_numel(), bias.partition_numel(), bias.padding_size()]
engine, *_ = dsrun.initialize(model=model, config={
    "train_batch_size": 2 * dist.get_world_size(), "zero_optimization": {"stage": 3},
    "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
loss = engine(torch.ones(2, 4)).pow(2).mean()
engine.backward(loss)
engine.step()
facts.append(engine.global_steps)
with open(f"{sys.argv[1]}/rank{dist.get_rank()}.txt", "w") as out:
    out.write(" ".join(map(str, facts)))
# leave together (what is tested here is how the group starts, not how a
# torchrun job exits: once, under heavy load, a rank aborted at exit with
# "terminate called without an active exception" when they did not)
dist.barrier()
dist.destroy_process_group()
"""


def env_without_group(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["DSRUN_ACCELERATOR"] = "cpu"  # gloo even on a GPU host: the tensors are CPU ones
    env["PYTHONPATH"] = str(ROOT)
    env.update(extra)
    return env


def facts(out: Path) -> list[str]:
    return [f.read_text() for f in sorted(out.glob("rank*.txt"))]


def run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120,
                          cwd=str(ROOT))


def test_zero_init_starts_a_world_size_one_group_under_plain_python(tmp_path: Path) -> None:
    script = tmp_path / "init_first.py"
    script.write_text(SCRIPT)
    res = run([sys.executable, str(script), str(tmp_path)], env_without_group())
    assert res.returncode == 0, res.stderr[-3000:]
    # rank, world size, numel, shard, partition_numel of it and of a 3-element
    # bias, the bias's padding, steps
    assert facts(tmp_path) == ["0 1 32 32 32 3 0 1"]


def test_zero_init_takes_the_rank_from_torchruns_environment(tmp_path: Path) -> None:
    script = tmp_path / "init_first.py"
    script.write_text(SCRIPT)
    # torchrun leaves a torchelastic_* log directory in TMPDIR: keep it in tmp_path
    res = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", str(script), str(tmp_path)],
              env_without_group(TMPDIR=str(tmp_path)))
    assert res.returncode == 0, res.stderr[-3000:]
    # each rank holds half; the bias's shards are 2 and 2 of 3 (padding 1)
    assert facts(tmp_path) == ["0 2 32 16 16 2 1 1", "1 2 32 16 16 2 1 1"]


def test_a_group_that_cannot_start_is_one_clear_error(tmp_path: Path) -> None:
    script = tmp_path / "no_master.py"
    script.write_text("import torch, dsrun\n"
                      "with dsrun.zero.Init():\n"
                      "    torch.nn.Linear(2, 2)\n")
    res = run([sys.executable, str(script)], env_without_group(RANK="1", WORLD_SIZE="2"))
    assert res.returncode != 0
    assert "DsrunError: zero.Init needs torch.distributed and could not start it: world " \
           "size 2" in res.stderr
    assert "MASTER_ADDR" in res.stderr
