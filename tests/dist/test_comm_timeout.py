"""The process group's timeout on 2 gloo ranks under dsrun
(``workers/comm_timeout.py``): DEEPSPEED_TIMEOUT sets the group dsrun
starts, and ``deepspeed.init_distributed(timeout=...)`` in the script sets
its own on that group, so a collective really times out after it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import ROOT, rank_results

pytestmark = pytest.mark.dist


def test_init_distributed_timeout_applies_to_dsruns_group(tmp_path: Path) -> None:
    results = rank_results(ROOT / "tests" / "dist" / "workers" / "comm_timeout.py", tmp_path,
                           world=2, timeout=120, env={"DEEPSPEED_TIMEOUT": "7"})
    for fact in results:
        assert fact["before"] == 7 * 60  # DEEPSPEED_TIMEOUT, minutes
        assert fact["after"] == 2.0
    first = results[0]
    assert first["error"] is not None and "Timed out" in first["error"], first["error"]
    assert 1.5 <= first["waited"] < 9, first  # the 2 s, not rank 1's 12 s
