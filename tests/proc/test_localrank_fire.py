"""``--local_rank`` filled in for scripts that parse with ``fire``
(dsrun/runtime/localrank.py): DeepSpeedExamples' HelloDeepSpeed
``train_bert_ds.py`` runs ``fire.Fire(train)`` with a ``local_rank: int = -1``
parameter, and gets N from DeepSpeed's launcher.

fire is not a dependency: the ranks import the stand-in package of
tests/fire_standin.py (fire's calling convention, functions and classes)
from PYTHONPATH. The same behaviour was checked by hand with fire 0.7.1.
"""

from __future__ import annotations

import os

import pytest

from tests.conftest import run_dsrun
from tests.fire_standin import write_fire_standin

SCRIPT = '''import os
import fire


def train(steps: int = 1, local_rank: int = -1):
    print(f"local_rank {local_rank} env {os.environ['LOCAL_RANK']} steps {steps}", flush=True)


if __name__ == "__main__":
    fire.Fire(train)
'''


@pytest.mark.parametrize("extra,expected", [
    ((), "{lr}"), (("--no_local_rank",), "-1"), (("--local_rank_arg",), "{lr}")])
def test_fire_scripts_get_their_local_rank(tmp_path, extra, expected):
    write_fire_standin(tmp_path)
    (tmp_path / "train_fire.py").write_text(SCRIPT)
    res = run_dsrun("--cpu", "--num_gpus", "2", "--dist_backend", "none", *extra,
                    str(tmp_path / "train_fire.py"), "--steps", "3",
                    env={"PYTHONPATH": os.pathsep.join(
                        filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))})
    assert res.returncode == 0, res.stderr
    for lr in (0, 1):
        assert f"local_rank {expected.format(lr=lr)} env {lr} steps 3" in res.stdout, res.stdout
