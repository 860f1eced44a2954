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
