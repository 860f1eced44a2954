"""mpirun's kill sequence gets dsrun's --kill_grace (openmpi.py, pure).

On a SIGTERM of its own mpirun sends its processes (the agents) SIGCONT,
then SIGTERM and SIGKILL ``odls_base_sigkill_timeout`` seconds apart (1 s by
default): the command sets it from --kill_grace, unless the user did.
"""

from __future__ import annotations

import pytest

from dsrun.launcher.backends.openmpi import (
    SIGKILL_TIMEOUT,
    OpenMpiBackend,
    mpirun_argv,
    sigkill_timeout,
)
from dsrun.launcher.cluster import Cluster
from dsrun.launcher.envpolicy import job_env
from dsrun.launcher.hostfile import parse_hostfile
from dsrun.launcher.plan import NodeFacts, build_plan
from dsrun.launcher.resources import select_resources
from dsrun.launcher.spec import HostsSpec, LaunchSpec

AGENT = ("/venv/bin/python", "-m", "dsrun.launcher.agent")


def _plan(kill_grace: float):
    nodes = select_resources(parse_hostfile("node1 slots=2\n", "hf"), None, None, None, None)
    cluster = Cluster("hf", ("node1",), tuple(n.slots for n in nodes), (True,), "openmpi")
    spec = LaunchSpec(script="train.py", kill_grace=kill_grace)
    return build_plan(spec, cluster, job_env({}, remote=True), "j", facts=[NodeFacts((), 8)],
                      python=AGENT[0], cwd="/work", master=("10.0.0.1", 29500))


def _timeout(argv: tuple[str, ...]) -> list[str]:
    """The values of every --mca odls_base_sigkill_timeout in ``argv``."""
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == SIGKILL_TIMEOUT]


@pytest.mark.parametrize("grace,expected", [(30.0, 31), (2.5, 4), (0.0, 1), (7.0, 8)])
def test_sigkill_timeout_is_the_grace_and_one_second(grace, expected):
    assert sigkill_timeout(grace) == expected


def test_mpirun_gives_the_agents_the_kill_grace():
    argv = mpirun_argv(_plan(12.0), AGENT)
    i = argv.index(SIGKILL_TIMEOUT)
    assert argv[i - 1] == "--mca" and argv[i + 1] == "13"
    assert i < argv.index(AGENT[0])  # an mpirun option, not the agent's


@pytest.mark.parametrize("args", [("--mca", SIGKILL_TIMEOUT, "5"),
                                  ("-mca", SIGKILL_TIMEOUT, "5"),
                                  ("--gmca", SIGKILL_TIMEOUT, "5")])
def test_the_users_setting_in_launcher_args_is_kept(args):
    argv = mpirun_argv(_plan(12.0), AGENT, launcher_args=args)
    assert _timeout(argv) == ["5"]


def test_the_users_setting_in_the_environment_is_kept():
    plan = _plan(12.0)
    backend = OpenMpiBackend(HostsSpec(), python=AGENT[0],
                             environ={"OMPI_MCA_odls_base_sigkill_timeout": "3"})
    assert _timeout(backend.argv(plan)) == []
    assert _timeout(OpenMpiBackend(HostsSpec(), python=AGENT[0], environ={}).argv(plan)) \
        == ["13"]
