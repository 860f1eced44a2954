"""A DeepSpeed checkpoint of a model holding one submodule under three names.

The fixtures (tests/data/deepspeed_ckpt/alias_*, written by make_alias.py
with DeepSpeed 0.19.8 on 2 ranks) hold ``Block`` as ``block``,
``blocks["0"]`` and ``also``. DeepSpeed's ``shared_params`` names
``blocks.0.*`` only; its module state dict lists all three names (at
stage 3 a parameter's entries are 0-element placeholders, its buffers are
shared). The import must take ``also.*`` and ``blocks.0.gain`` as second
names - not refuse them (stage 3) nor store them as frozen parameters or
buffers of their own (stages 1-2) - so that:

* the consolidated weights are the live engine's, under every name of the
  model's ``state_dict()`` and in its order, and equal DeepSpeed's
  ``zero_to_fp32`` where it has the name;
* ``checkpoint info`` counts what a dsrun save of the same model counts;
* dsrun, loading the import on one rank, holds DeepSpeed's fp32 masters
  and Adam moments exactly and continues on DeepSpeed's curve.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import dsrun
from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint import from_deepspeed
from dsrun.runtime.checkpoint.consolidate import get_fp32_state_dict
from dsrun.runtime.checkpoint.from_deepspeed import (
    import_deepspeed_checkpoint,
    read_deepspeed_checkpoint,
)
from dsrun.runtime.checkpoint.info import checkpoint_info
from dsrun.utils.tensor_fragment import safe_get_full_fp32_param, safe_get_full_optimizer_state
from tests.data.deepspeed_ckpt import make_alias
from tests.data.deepspeed_ckpt import model as spec

DATA = Path(__file__).resolve().parents[1] / "data" / "deepspeed_ckpt"
NAMES = sorted(make_alias.FIXTURES)
TOLERANCE = {"fp32": 1e-6, "fp16": 5e-4}  # tests/dist/test_from_deepspeed.py's
COUNTS = ("parameters", "trainable_parameters", "parameter_tensors", "buffers", "tied")


def expected(name: str) -> dict[str, Any]:
    return torch.load(DATA / name / "expected.pt", weights_only=False)


class Imports(dict):
    """Each fixture imported once, when a test first asks for it."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        super().__init__()
        self.factory = factory

    def __missing__(self, name: str) -> Path:
        root = self.factory.mktemp(name) / "ckpt"
        import_deepspeed_checkpoint(str(DATA / name), str(root))
        self[name] = root
        return root


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> Imports:
    return Imports(tmp_path_factory)


@pytest.mark.parametrize("name", NAMES)
def test_every_name_of_the_state_dict_holds_the_live_engines_value(
        name: str, imported: Imports) -> None:
    got = get_fp32_state_dict(str(imported[name]))
    want = expected(name)
    assert list(got) == want["state_dict_keys"]
    for key, value in want["values"].items():
        assert torch.equal(got[key], value.float()), key
    assert "also.lin.weight" not in want["zero_to_fp32"]  # DeepSpeed's tool drops the third name
    for key, value in want["zero_to_fp32"].items():
        assert torch.equal(got[key], value), key
    for second in ("blocks.0.lin.weight", "also.lin.weight"):
        assert got[second] is got["block.lin.weight"]  # one tensor, as the model's tie


def _engine(name: str) -> Any:
    stage, precision = make_alias.FIXTURES[name]
    module = make_alias.build()
    engine, *_ = dsrun.initialize(model=module,
                                  model_parameters=spec.param_groups(module, stage),
                                  config=spec.config(stage, precision, 1))
    return engine


@pytest.mark.parametrize("name", NAMES)
def test_info_counts_a_dsrun_save_of_the_model_and_dsrun_resumes_on_deepspeeds_curve(
        name: str, imported: Imports, solo: None, tmp_path: Path) -> None:
    engine = _engine(name)
    engine.save_checkpoint(str(tmp_path / "native"))
    native = checkpoint_info(str(tmp_path / "native")).selected.summary()
    mine = checkpoint_info(str(imported[name])).selected.summary()
    assert {k: mine[k] for k in COUNTS} == {k: native[k] for k in COUNTS}
    assert mine["tied"]["also.lin.weight"] == "block.lin.weight"

    engine.load_checkpoint(str(imported[name]))
    want = expected(name)
    for pname, p in engine.module.named_parameters():  # the masters, exactly
        assert torch.equal(safe_get_full_fp32_param(p), want["values"][pname]), pname
    moments = {p.name: p.state for p in read_deepspeed_checkpoint(str(DATA / name)).params}
    for pname, p in engine.module.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(safe_get_full_optimizer_state(p, key).reshape(-1),
                               moments[pname][key].reshape(-1)), (pname, key)
    precision = make_alias.FIXTURES[name][1]
    losses = []
    for _ in range(spec.CONTINUE):
        x, y = spec.batch(engine.global_steps, 0, 1, precision)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    engine.destroy()
    # one rank reduces fp16 gradients otherwise than DeepSpeed's two: the first
    # two steps (the loaded weights, then one Adam step on the loaded moments)
    # agree to fp16's rounding, later ones drift apart (seen: 4e-3 at step 4)
    for step, (mine, theirs) in enumerate(zip(losses, want["losses"])):
        assert abs(mine - theirs) <= TOLERANCE[precision] * (1 if step < 2 else 10), \
            (step, losses, want["losses"])


def _with(monkeypatch: pytest.MonkeyPatch, entries: dict[str, torch.Tensor]) -> None:
    """Stage-3 model files read with ``entries`` added to their module dict."""
    real = from_deepspeed.load

    def load(path: str) -> dict[str, Any]:
        data = real(path)
        if path.endswith("model_states.pt"):
            data["module"].update({k: v.clone() for k, v in entries.items()})
        return data

    monkeypatch.setattr(from_deepspeed, "load", load)


def test_an_entry_of_no_kind_is_an_error_that_calls_it_no_parameter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _with(monkeypatch, {"stray": torch.ones(3)})
    with pytest.raises(CheckpointError) as info:
        read_deepspeed_checkpoint(str(DATA / "alias_stage3_fp32"))
    assert "module entry 'stray' (3 elements)" in str(info.value)
    assert "buffer_names" in str(info.value) and "parameter 'stray'" not in str(info.value)


def test_a_placeholder_of_no_unique_match_is_left_to_the_models_ties(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
        ) -> None:
    # "copy" looks like fc1, block.lin and fc3 alike: which it is, is unknown
    _with(monkeypatch, {"copy.weight": torch.empty(0), "copy.bias": torch.empty(0)})
    with caplog.at_level("WARNING", logger="dsrun.runtime.checkpoint"):
        import_deepspeed_checkpoint(str(DATA / "alias_stage3_fp32"), str(tmp_path / "out"))
    assert "'copy.weight' is a second name" in caplog.text
    got = get_fp32_state_dict(str(tmp_path / "out"))
    assert "copy.weight" not in got and "also.lin.weight" in got


def test_look_alike_modules_are_told_apart_by_the_second_names_known_under_them() -> None:
    """Stage 3: ``c`` is ``a``, ``b`` has the same entries; ``c.gain``
    shares ``a.gain``'s storage, which picks ``a``."""
    from dsrun.runtime.checkpoint.from_deepspeed_aliases import module_aliases

    gain_a, gain_b = torch.ones(4), torch.zeros(4)
    module = {}
    for prefix, gain in (("a", gain_a), ("b", gain_b), ("c", gain_a)):
        module.update({f"{prefix}.gain": gain, f"{prefix}.lin.weight": torch.empty(0),
                       f"{prefix}.lin.bias": torch.empty(0)})
    held = ["a.lin.weight", "a.lin.bias", "b.lin.weight", "b.lin.bias"]
    aliases = module_aliases(module, {}, held, ["a.gain", "b.gain"], 3)
    assert aliases == {"c.gain": "a.gain", "c.lin.weight": "a.lin.weight",
                       "c.lin.bias": "a.lin.bias"}
    module["c.gain"] = torch.ones(4)  # nothing tells a from b: ambiguous, left unresolved
    assert module_aliases(module, {}, held, ["a.gain", "b.gain"], 3) == {}
