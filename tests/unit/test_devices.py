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
])
def test_cuda_visible_devices(monkeypatch, cvd, physical, expected):
    monkeypatch.setattr(devices, "_physical_count", lambda: physical)
    assert devices.visible_devices({"CUDA_VISIBLE_DEVICES": cvd}) == expected


def test_all_physical_devices_without_cvd_and_fake_count_wins(monkeypatch):
    monkeypatch.setattr(devices, "_physical_count", lambda: 3)
    assert devices.visible_devices({}) == (0, 1, 2)
    assert devices.visible_devices({"DSRUN_FAKE_GPUS": "2", "CUDA_VISIBLE_DEVICES": ""}) == \
        (0, 1)
