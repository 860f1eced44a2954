"""Fixtures for cluster tests: four simulated hosts with sshd, checked for leftovers.

``sim_cluster`` (session) is a started :class:`simhosts.SimCluster` with hosts
node1..node4; it is skipped with the reason when this machine cannot build
one (not root, no ``ip netns``, no sshd). ``cluster_clean`` (function) yields
the same cluster and, after the test, fails it if any process other than sshd
is left on any host (after killing them, so one leak does not fail the next
tests too). Every test that uses ``sim_cluster`` gets that check
automatically. At the end of the session the cluster is checked once more
and always torn down.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from simhosts import SimCluster, preflight  # noqa: E402
from slurmhosts import SlurmCluster, slurm_preflight  # noqa: E402

# How long processes of a finished test may take to exit (agents noticing EOF,
# --kill_grace, SIGKILL of setsid grandchildren); a clean host returns at once.
CLEAN_TIMEOUT_S = 15.0
# how long a finished job may stay COMPLETING in squeue (slurmd cleanup)
SLURM_JOB_END_TIMEOUT_S = 30.0


@pytest.fixture(scope="session")
def sim_cluster() -> Iterator[SimCluster]:
    reason = preflight()
    if reason is not None:
        pytest.skip(reason)
    cluster = SimCluster(4).start()  # start() tears down what it built if it fails
    try:
        yield cluster
        # Raising here makes pytest report an error at session teardown.
        cluster.wait_clean(CLEAN_TIMEOUT_S)
    finally:
        cluster.teardown()


@pytest.fixture
def cluster_clean(sim_cluster: SimCluster) -> Iterator[SimCluster]:
    yield sim_cluster
    try:
        sim_cluster.wait_clean(CLEAN_TIMEOUT_S)
    except AssertionError:
        sim_cluster.kill_strays()
        raise


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """A real Slurm (slurmctld, one slurmd per host) on two simulated hosts of
    its own; skipped with the exact reason when it cannot be built here."""
    reason = preflight() or slurm_preflight()
    if reason is not None:
        pytest.skip(reason)
    sim = SimCluster(2).start()
    try:
        slurm = _start_slurm(sim)
        try:
            yield slurm
            # Jobs first: a COMPLETING job's slurmstepd is still on its hosts.
            left = slurm.wait_no_jobs(SLURM_JOB_END_TIMEOUT_S)
            sim.wait_clean(CLEAN_TIMEOUT_S)
            assert left == [], f"Slurm jobs left: {left}"
        finally:
            slurm.teardown()
    finally:
        sim.teardown()


def _start_slurm(sim: SimCluster) -> SlurmCluster:
    """A started SlurmCluster on ``sim``, or a skip with the reason. On CI
    (``CI=true``) a failed start (a port taken between choosing and binding
    it, daemons slow under load) is tried once more, with new ports, before
    the Slurm tests are skipped."""
    tries = 2 if os.environ.get("CI", "").lower() == "true" else 1
    for attempt in range(1, tries + 1):
        try:
            return SlurmCluster(sim).start(timeout=60.0)
        except RuntimeError as exc:  # start() has torn down what it built
            if attempt == tries:
                pytest.skip(f"a test Slurm could not be started here "
                            f"({attempt} attempt(s)): {exc}")
            print(f"a test Slurm did not start ({exc}); trying again", file=sys.stderr)
    raise AssertionError("unreachable")


@pytest.fixture
def slurm_clean(slurm_cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    yield slurm_cluster
    try:
        # Jobs first: while a job is COMPLETING its slurmstepd (and, within
        # KillWait, its tasks) may still run on the hosts.
        left = slurm_cluster.wait_no_jobs(SLURM_JOB_END_TIMEOUT_S)
        slurm_cluster.sim.wait_clean(CLEAN_TIMEOUT_S)
        assert left == [], f"Slurm jobs left: {left}"
    except AssertionError:
        slurm_cluster.sim.kill_strays()
        raise


@pytest.fixture(autouse=True)
def _cluster_leak_check(request: pytest.FixtureRequest) -> None:
    # Autouse fixtures are set up first, so cluster_clean's check runs after
    # every other fixture of the test has torn down (stopped its jobs).
    if "sim_cluster" in request.fixturenames:
        request.getfixturevalue("cluster_clean")
    if "slurm_cluster" in request.fixturenames:
        request.getfixturevalue("slurm_clean")
