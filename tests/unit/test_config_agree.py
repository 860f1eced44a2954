"""Which resolved config keys differ between ranks (config_agree.py), pure."""

from __future__ import annotations

from dsrun.runtime.config import resolve
from dsrun.runtime.config_agree import _flat, check_ranks_agree, differing_keys


def _config(**extra: object):
    return resolve({"train_batch_size": 2, **extra}, dp_size=1, dp_source="test")


def test_the_keys_that_differ_are_named_and_the_file_path_is_not_one():
    a = _flat(_config(gradient_clipping=1.0, zero_optimization={"stage": 1}))
    b = _flat(_config(gradient_clipping=0.5, zero_optimization={"stage": 2}))
    assert differing_keys([a, b]) == ["gradient_clipping", "zero_optimization.stage"]
    assert differing_keys([a, dict(a)]) == []
    assert "source" not in a and not any(k.endswith(".source") for k in a)


def test_world_of_one_or_no_group_checks_nothing():
    assert check_ranks_agree(_config()) == []
