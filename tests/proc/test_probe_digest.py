"""The launcher hashes dsrun's sources (every file read) only where the
digest is compared: when the probe compares versions (jobs on several
hosts, ``dsrun doctor``), never for a job on this host alone."""

from __future__ import annotations

import os
import uuid

from dsrun.launcher import preflight
from dsrun.launcher.cluster import here_facts, probe_cluster, resolve_cluster
from dsrun.launcher.envpolicy import JobEnv
from dsrun.launcher.plan import build_plan
from dsrun.launcher.spec import HostsSpec, LaunchSpec


def _probe(tmp_path, versions: bool):  # noqa: ANN202 - a ProbeOutcome
    hs = HostsSpec(hostfile=None, num_gpus=1, cpu=True)
    cluster, backend = resolve_cluster(hs, str(tmp_path))
    spec = LaunchSpec(script="job.py", num_gpus=1, cpu=True)
    plan = build_plan(spec, cluster, JobEnv(), uuid.uuid4().hex, facts=here_facts(cluster),
                      python=backend.python, cwd=os.getcwd())
    handle = backend.open(plan, lambda *a: None)
    try:
        return probe_cluster(handle, cluster, backend, hs, versions=versions)
    finally:
        handle.close()


def test_a_probe_without_versions_hashes_nothing(tmp_path, monkeypatch):
    calls: list[object] = []
    real = preflight.dsrun_sources
    monkeypatch.setattr(preflight, "dsrun_sources", lambda *a: calls.append(a) or real(*a))
    monkeypatch.chdir(tmp_path)
    assert not _probe(tmp_path, versions=False).failed()
    assert calls == [], "the sources were hashed for a probe that compares no versions"
    assert not _probe(tmp_path, versions=True).failed()
    assert len(calls) == 1
