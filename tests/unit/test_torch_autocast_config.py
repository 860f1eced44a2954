"""The ``torch_autocast`` config section (pure): parsing, the errors it
gives, and :class:`GradScalerRule` against torch's own scale update
(``torch._amp_update_scale_``, what ``torch.amp.GradScaler.update`` runs)."""

from __future__ import annotations

import pytest
import torch

from dsrun.errors import DsrunConfigError
from dsrun.runtime.config import resolve
from dsrun.runtime.precision import GradScalerRule


def config(**sections: object) -> object:
    return resolve({"train_batch_size": 4, **sections}, dp_size=1, dp_source="test")


def test_the_section_is_parsed_and_named_in_the_summary() -> None:
    c = config(torch_autocast={"enabled": True, "dtype": "torch.float16",
                               "lower_precision_safe_modules": ["torch.nn.Linear"]})
    assert c.torch_autocast.enabled and c.torch_autocast.torch_dtype("cpu") == "float16"
    assert "torch_autocast torch.float16" in c.summary()
    assert "torch_autocast" not in c.passthrough
    default = config(torch_autocast={"enabled": True})
    assert default.torch_autocast.torch_dtype("cpu") == "bfloat16"
    assert default.torch_autocast.torch_dtype("cuda") == "float16"
    assert not config().torch_autocast.enabled


@pytest.mark.parametrize("section, message", [
    ({"enabled": True, "dtype": "int8"}, '"torch_autocast.dtype"'),
    ({"enabled": True, "lower_precision_safe_modules": "torch.nn.Linear"},
     "must be a list of dotted class names"),
    ({"enabled": True, "lower_precision_safe_modules": ["Linear"]},
     "must be a list of dotted class names"),
    ({"enabeld": True}, 'did you mean "enabled"'),
])
def test_bad_values_are_named(section: dict, message: str) -> None:
    with pytest.raises(DsrunConfigError, match=message):
        config(torch_autocast=section)


@pytest.mark.parametrize("other", ("fp16", "bf16"))
def test_with_fp16_or_bf16_is_an_error(other: str) -> None:
    with pytest.raises(DsrunConfigError, match=f"torch_autocast.enabled and {other}.enabled"):
        config(torch_autocast={"enabled": True}, **{other: {"enabled": True}})
    config(torch_autocast={"enabled": False}, **{other: {"enabled": True}})


def test_grad_scaler_rule_follows_torch() -> None:
    """Overflows alone, in a row and after long clean runs, over more than
    two growth intervals: the same scale at every step as torch's update."""
    overflows = {3, 4, 5, 700, 2701, 4702}
    rule = GradScalerRule()
    scale, tracker = torch.tensor([2.0**16]), torch.tensor([0], dtype=torch.int32)
    grew = 0
    for step in range(7000):
        before = rule.scale
        found_inf = torch.tensor([1.0 if step in overflows else 0.0])
        torch._amp_update_scale_(scale, tracker, found_inf, 2.0, 0.5, 2000)
        skipped = rule.update(step in overflows)
        assert skipped == (step in overflows)
        assert rule.scale == float(scale), step
        grew += rule.scale > before
    assert grew == 3  # the 2000th clean step after 700, 2701 and 4702
