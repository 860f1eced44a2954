"""Bucket sizes the ranks refuse are refused when the config is resolved,
so the launcher's ``--config`` check names FILE:LINE instead of every rank
failing with a message that names no file: ``reduce_bucket_size`` must be
> 0 at every stage (as DeepSpeed's config check), ``allgather_bucket_size``
> 0 at stages 1-2 (DeepSpeed takes 0 there; dsrun's ZeRO 1/2 buckets by it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsrun.errors import DsrunConfigError, DsrunUsageError
from dsrun.launcher.configcheck import check_config
from dsrun.runtime.config import resolve


def _data(**zero: object) -> dict:
    return {"train_batch_size": 2, "zero_optimization": zero}


REFUSED = [(stage, "reduce_bucket_size") for stage in (0, 1, 2, 3)] + \
    [(stage, "allgather_bucket_size") for stage in (1, 2)]


@pytest.mark.parametrize("stage,key", REFUSED)
def test_a_zero_size_is_refused_naming_file_and_line(tmp_path: Path, stage: int,
                                                     key: str) -> None:
    data = _data(stage=stage, **{key: 0})
    with pytest.raises(DsrunConfigError, match=rf'"zero_optimization\.{key}" in .*>= 1.*got 0'):
        resolve(data, dp_size=1, dp_source="test")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(data, indent=2))
    with pytest.raises(DsrunUsageError, match=rf"--config {path}:5: .*{key}"):
        check_config(str(path), 1, {})


@pytest.mark.parametrize("stage", [0, 3])
def test_allgather_bucket_size_0_where_unused_is_accepted(stage: int) -> None:
    zero = resolve(_data(stage=stage, allgather_bucket_size=0), dp_size=1,
                   dp_source="test").zero_optimization
    assert zero.allgather_bucket_size == 0
