"""Infinite and NaN numbers are refused wherever the config holds a number
(``Infinity``/``NaN``/``1e400`` in a JSON file, ``float("inf")`` in a dict):
they trained NaNs (lr, weight decay, eps, momentum, scheduler lrs,
gradient_predivide_factor) or skipped every step (fp16 loss_scale)
silently. The error names the key, and FILE:LINE under ``dsrun --config``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from dsrun.errors import DsrunConfigError, DsrunUsageError
from dsrun.launcher.configcheck import check_config
from dsrun.runtime.config import resolve
from dsrun.runtime.config_schema import Check, check_value

INF, NAN = math.inf, math.nan
BASE: dict[str, Any] = {"train_batch_size": 2}


def _adam(**params: Any) -> dict:
    return {**BASE, "optimizer": {"type": "Adam", "params": {"lr": 0.1, **params}}}


def _sched(kind: str, **params: Any) -> dict:
    return {**_adam(), "scheduler": {"type": kind, "params": params}}


CASES = [
    (_adam(lr=INF), "optimizer.params.lr"),
    (_adam(weight_decay=INF), "optimizer.params.weight_decay"),
    (_adam(eps=NAN), "optimizer.params.eps"),
    (_adam(betas=[0.9, NAN]), "optimizer.params.betas.1"),
    ({**BASE, "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": INF}}},
     "optimizer.params.momentum"),
    ({**BASE, "optimizer": {"type": "Lamb", "params": {"max_coeff": INF}}},
     "optimizer.params.max_coeff"),
    (_sched("WarmupLR", warmup_max_lr=INF), "scheduler.params.warmup_max_lr"),
    (_sched("WarmupLR", warmup_max_lr=[NAN]), "scheduler.params.warmup_max_lr.0"),
    (_sched("OneCycle", cycle_min_lr=0.0, cycle_max_lr=INF), "scheduler.params.cycle_max_lr"),
    (_sched("StepLR", step_size=1, gamma=INF), "scheduler.params.gamma"),
    ({**BASE, "fp16": {"enabled": True, "loss_scale": INF}}, "fp16.loss_scale"),
    ({**BASE, "fp16": {"enabled": True, "min_loss_scale": -INF}}, "fp16.min_loss_scale"),
    ({**BASE, "gradient_clipping": INF}, "gradient_clipping"),
    ({**BASE, "gradient_predivide_factor": INF}, "gradient_predivide_factor"),
]


@pytest.mark.parametrize("data,key", CASES, ids=[key for _, key in CASES])
def test_a_dict_config_names_the_key(data: dict, key: str) -> None:
    with pytest.raises(DsrunConfigError, match=rf'"{key}" in config dict must be a finite '
                                               "number"):
        resolve(data, dp_size=1, dp_source="test")


@pytest.mark.parametrize("data,key", CASES, ids=[key for _, key in CASES])
def test_a_json_file_names_the_key_and_the_launcher_its_line(tmp_path: Path, data: dict,
                                                             key: str) -> None:
    path = tmp_path / "ds.json"
    text = json.dumps(data, indent=2)  # writes Infinity/NaN, as a hand-written file may
    path.write_text(text)
    with pytest.raises(DsrunConfigError, match=rf'"{key}" in {path} must be a finite number'):
        resolve(str(path), dp_size=1, dp_source="test")
    last = key.split(".")[-1]
    if last.isdigit():  # a list element: the line of the list's key
        last = key.split(".")[-2]
    line = next(i for i, row in enumerate(text.splitlines(), 1) if f'"{last}"' in row)
    with pytest.raises(DsrunUsageError, match=rf"--config {path}:{line}: .*{key}.*finite"):
        check_config(str(path), 1, {})


def test_1e400_is_refused_in_a_file(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 2,\n "optimizer": {"type": "Adam",\n'
                    ' "params": {"lr": 0.1, "weight_decay": 1e400}}}')
    with pytest.raises(DsrunUsageError, match=rf"{path}:3: .*weight_decay.*finite"):
        check_config(str(path), 1, {})


@pytest.mark.parametrize("spec", [Check("float"), Check("floats"), Check("int"),
                                  Check("float", low=0.0)])
def test_the_schema_check_refuses_nonfinite(spec: Check) -> None:
    for value in (INF, -INF, NAN, [1.0, INF]):
        if spec.kind != "floats" and isinstance(value, list):
            continue
        with pytest.raises(DsrunConfigError, match="here must be a finite number"):
            check_value(value, spec, "here")


def test_finite_values_pass() -> None:
    c = resolve(_sched("WarmupLR", warmup_max_lr=[0.1], warmup_num_steps=5),
                dp_size=1, dp_source="test")
    assert c.optimizer.params["lr"] == 0.1


def test_steps_per_print_infinity_still_means_never_but_nan_is_refused() -> None:
    assert resolve({**BASE, "steps_per_print": INF}, dp_size=1,
                   dp_source="test").steps_per_print is None
    with pytest.raises(DsrunConfigError, match='"steps_per_print" in config dict must be a '
                                               "finite number"):
        resolve({**BASE, "steps_per_print": NAN}, dp_size=1, dp_source="test")
