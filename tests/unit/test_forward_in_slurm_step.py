"""SIGUSR1/2 in a node agent that is a task of a Slurm step (agent_forward.py).

Slurm signals every process of a step (scancel --signal, srun passing on a
signal it got), the ranks included: the agent's own copy must not reach the
ranks a second time, nor may the launcher's command for the same delivery.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from dsrun.launcher import agent_forward
from dsrun.launcher.agent_forward import MERGE, Forwarder

USR1, USR2 = int(signal.SIGUSR1), int(signal.SIGUSR2)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _forwarder() -> tuple[Forwarder, _Clock, list[int]]:
    clock, sent = _Clock(), []
    return Forwarder(sent.append, clock, step=True), clock, sent


def test_the_agents_own_copy_is_never_forwarded_in_a_slurm_step():
    fwd, clock, sent = _forwarder()
    fwd.note(USR1, launcher=False)  # scancel --signal=USR1: the ranks got it too
    clock.now += 3 * MERGE
    fwd.settle()
    assert sent == []


def test_dsrun_s_command_alone_is_forwarded_after_merge():
    fwd, clock, sent = _forwarder()
    fwd.note(USR2, launcher=True)  # kill -USR2 $DSRUN_PID in the batch script
    fwd.settle()
    assert sent == []  # the step's own copy may still come
    clock.now += 2 * MERGE
    fwd.settle()
    assert sent == [USR2]


def test_dsrun_s_command_and_the_steps_copy_are_one_delivery_in_either_order():
    fwd, clock, sent = _forwarder()
    fwd.note(USR1, launcher=False)  # every process of the job got it
    clock.now += 0.1
    fwd.note(USR1, launcher=True)
    clock.now += 3 * MERGE
    fwd.settle()
    fwd.note(USR1, launcher=True)  # dsrun's first this time, then srun's copy
    clock.now += 0.2
    fwd.note(USR1, launcher=False)
    clock.now += 3 * MERGE
    fwd.settle()
    assert sent == []


def test_a_stop_drops_a_held_command():
    fwd, clock, sent = _forwarder()
    fwd.note(USR1, launcher=True)
    fwd.drop()
    clock.now += 3 * MERGE
    fwd.settle()
    assert sent == []


def test_only_a_task_of_a_slurm_step_is_one(tmp_path):
    assert agent_forward.in_slurm_step() is False  # pytest's parent is not slurmstepd
    assert Forwarder(lambda s: None).step is False
    # A parent whose command name is slurmstepd: the interpreter under that
    # name (the kernel names a process after the file it executed).
    stepd = tmp_path / "slurmstepd"
    stepd.symlink_to(sys.executable)
    code = "from dsrun.launcher.agent_forward import in_slurm_step; print(in_slurm_step())"
    parent = f"import subprocess, sys; subprocess.run([{sys.executable!r}, '-c', {code!r}])"
    root = os.path.dirname(os.path.dirname(os.path.abspath(agent_forward.__file__)))
    out = subprocess.run([str(stepd), "-c", parent], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": os.path.dirname(root)}, check=True)
    assert out.stdout.strip() == "True", out.stderr
