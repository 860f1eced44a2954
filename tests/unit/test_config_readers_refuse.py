"""Every reader of a DeepSpeed config refuses what initialize() refuses:
zero.Init(config_dict_or_path=...) and checkpointing.configure() read the
config through load_config, which now runs DeepSpeed 0.19.8's removed-key
check (DeepSpeed's own Init and configure() build a DeepSpeedConfig, which
runs it); and a number that overflows a float (``1e400``) is named as
such, with its key and file, instead of "got Infinity"."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dsrun.errors import DsrunConfigError
from dsrun.runtime.config import load_config
from dsrun.runtime.zero.init import settings_from_config

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("config", [
    {"amp": {"enabled": False}},
    {"zero_optimization": {"stage": 3, "mics_shard_size": 2}},
    {"elasticity": {"enabled": True}},
])
def test_zero_init_s_config_reader_refuses_removed_keys(tmp_path, config) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    for given, where in ((config, "config dict"), (str(path), str(path))):
        with pytest.raises(DsrunConfigError, match=r"has been removed.*refuses this key") as err:
            settings_from_config(given)
        assert where in str(err.value)


def test_the_false_flags_dsrun_writes_itself_still_load() -> None:
    assert load_config({"sparse_gradients": False, "graph_harvesting": False})[0] == \
        {"sparse_gradients": False, "graph_harvesting": False}


def test_zero_init_refuses_a_removed_key_in_a_fresh_process(tmp_path) -> None:
    """The public call, as a script makes it (world size 1, no launcher)."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "amp": {"enabled": True}}))
    code = ("import dsrun, sys\n"
            "try:\n"
            f"    dsrun.zero.Init(config_dict_or_path={str(path)!r})\n"
            "except dsrun.errors.DsrunConfigError as exc:\n"
            "    print('refused:', exc); sys.exit(3)\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "DS_ACCELERATOR": "cpu",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120, cwd=tmp_path)
    assert res.returncode == 3, res.stdout + res.stderr
    assert f'refused: "amp" in {path}: NVIDIA Apex AMP integration has been removed' \
        in res.stdout


@pytest.mark.parametrize("literal", ["1e400", "-1e400", "123456789e999"])
def test_an_overflowing_number_is_named_as_such(tmp_path, literal) -> None:
    path = tmp_path / "ds.json"
    path.write_text('{"optimizer": {"type": "Adam", "params": {"lr": ' + literal + "}}}")
    with pytest.raises(DsrunConfigError) as err:
        load_config(str(path))
    text = str(err.value)
    assert text.startswith(f'"optimizer.params.lr" in {path}: the number {literal} overflowed')
    assert "Infinity" not in text


def test_infinity_written_as_such_keeps_its_message(tmp_path) -> None:
    path = tmp_path / "ds.json"
    path.write_text('{"gradient_clipping": Infinity}')
    with pytest.raises(DsrunConfigError, match=r'"gradient_clipping" in .* must be a finite '
                                               r"number, got Infinity"):
        load_config(str(path))


def test_steps_per_print_may_still_overflow_to_never(tmp_path) -> None:
    path = tmp_path / "ds.json"
    path.write_text('{"steps_per_print": 1e400}')
    assert load_config(str(path))[0]["steps_per_print"] == float("inf")


def test_checkpointing_configure_refuses_removed_keys() -> None:
    import dsrun.checkpointing as checkpointing

    with pytest.raises(DsrunConfigError, match=r'"amp" in config dict: NVIDIA Apex AMP'):
        checkpointing.configure(None, deepspeed_config={"amp": {"enabled": True}})
