"""GPU discovery without torch: CUDA_VISIBLE_DEVICES and the fake-count hook."""

from __future__ import annotations

import pytest

from dsrun.launcher import devices


@pytest.mark.parametrize("cvd,physical,expected", [
    ("0,1,2,3", 4, (0, 1, 2, 3)),
    ("2,3", 4, (2, 3)),
    ("", 4, ()),          # an empty list hides every GPU
    ("-1", 4, ()),
    ("1,7,2", 4, (1,)),   # CUDA stops at the first invalid entry
    ("0", 0, ()),         # no driver: nothing is visible
    # Slurm / Kubernetes name GPUs by UUID, MIG slices by their own ids
    ("GPU-8f2c1d3e-aaaa-bbbb-cccc-0123456789ab,GPU-1b2c", 2,
     ("GPU-8f2c1d3e-aaaa-bbbb-cccc-0123456789ab", "GPU-1b2c")),
    ("MIG-GPU-8f2c1d3e-aaaa-bbbb-cccc-0123456789ab/1/0", 1,
     ("MIG-GPU-8f2c1d3e-aaaa-bbbb-cccc-0123456789ab/1/0",)),
    ("MIG-3b6e9a1c-1111-2222-3333-444455556666", 1,
     ("MIG-3b6e9a1c-1111-2222-3333-444455556666",)),
    ("GPU-8f2c,bogus,GPU-1b2c", 2, ("GPU-8f2c",)),  # cut at the first invalid entry
    ("GPU-8f2c", 0, ()),                          # no driver: nothing is visible
])
def test_cuda_visible_devices(monkeypatch, cvd, physical, expected):
    monkeypatch.setattr(devices, "_physical_count", lambda: physical)
    assert devices.visible_devices({"CUDA_VISIBLE_DEVICES": cvd}) == expected


def test_all_physical_devices_without_cvd_and_fake_count_wins(monkeypatch):
    monkeypatch.setattr(devices, "_physical_count", lambda: 3)
    assert devices.visible_devices({}) == (0, 1, 2)
    assert devices.visible_devices({"DSRUN_FAKE_GPUS": "2", "CUDA_VISIBLE_DEVICES": ""}) == \
        (0, 1)


def test_uuid_devices_reach_the_ranks_as_uuids(monkeypatch):
    from dsrun.launcher.cluster import Cluster
    from dsrun.launcher.envpolicy import job_env
    from dsrun.launcher.plan import NodeFacts, build_plan
    from dsrun.launcher.rankenv import rank_env
    from dsrun.launcher.spec import LaunchSpec

    monkeypatch.setattr(devices, "_physical_count", lambda: 4)
    found = devices.visible_devices({"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb,GPU-cc"})
    assert found == ("GPU-aa", "GPU-bb", "GPU-cc")  # three GPUs, not zero (CPU ranks)
    cluster = Cluster("hf", ("h",), ((0, 2),), (True,), "local")
    plan = build_plan(LaunchSpec(script="t.py"), cluster, job_env({}, remote=False), "j",
                      facts=[NodeFacts(found, 8)], python="/py", cwd="/")
    node = plan.nodes[0]
    assert node.devices == ("GPU-aa", "GPU-cc")
    env = dict(rank_env(plan, node, node.ranks[1]).dsrun)
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-aa,GPU-cc"


@pytest.mark.parametrize("cvd,physical,twice", [
    ("0,0", 2, 0),
    ("1,0,1", 2, 1),
    (" 0, 00", 2, 0),   # the same ordinal, as CUDA's strtoul reads it
    ("GPU-aa,GPU-bb,GPU-aa", 2, "GPU-aa"),
    ("MIG-x1,MIG-x1", 1, "MIG-x1"),
])
def test_a_device_named_twice_leaves_no_device_as_in_torch(monkeypatch, cvd, physical, twice):
    monkeypatch.setattr(devices, "_physical_count", lambda: physical)
    env = {"CUDA_VISIBLE_DEVICES": cvd}
    assert devices.visible_devices(env) == ()
    assert devices.repeated_device(cvd, physical) == twice
    problem = devices.visible_devices_problem(env)
    assert problem == (f"CUDA_VISIBLE_DEVICES={cvd!r} names device {twice} twice, and CUDA "
                       f"(and torch) then see no GPU at all: list each device once, or set "
                       f"CUDA_VISIBLE_DEVICES='' (or pass --cpu) for CPU ranks")


@pytest.mark.parametrize("cvd", ["", "-1", "0,x,0", "1,0"])
def test_no_problem_when_no_device_is_repeated_before_the_cut(monkeypatch, cvd):
    monkeypatch.setattr(devices, "_physical_count", lambda: 2)
    assert devices.visible_devices_problem({"CUDA_VISIBLE_DEVICES": cvd}) is None


def test_a_job_here_with_a_repeated_device_is_one_usage_error(tmp_path, monkeypatch):
    from dsrun.errors import DsrunUsageError
    from dsrun.launcher import hostfile as hf
    from dsrun.launcher.cluster import resolve_cluster
    from dsrun.launcher.spec import HostsSpec

    monkeypatch.setattr(hf, "DEFAULT_JOB_HOSTFILE", str(tmp_path / "none"))
    monkeypatch.setattr(devices, "_physical_count", lambda: 2)
    monkeypatch.delenv("DSRUN_FAKE_GPUS", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,0")
    with pytest.raises(DsrunUsageError, match="CUDA_VISIBLE_DEVICES='0,0' names device 0 twice"):
        resolve_cluster(HostsSpec(), str(tmp_path))
    cluster, _ = resolve_cluster(HostsSpec(cpu=True), str(tmp_path))  # --cpu: GPUs unused
    assert cluster.slots == ((0, 1),)
