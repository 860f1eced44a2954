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

import time
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


def _with(monkeypatch: pytest.MonkeyPatch, entries: dict[str, Any]) -> None:
    """Model files read with ``entries`` added to their module dict."""
    real = from_deepspeed.load

    def load(path: str) -> dict[str, Any]:
        data = real(path)
        if path.endswith("model_states.pt"):
            data["module"].update({k: v.clone() if isinstance(v, torch.Tensor) else v
                                   for k, v in entries.items()})
        return data

    monkeypatch.setattr(from_deepspeed, "load", load)


def test_an_entry_of_no_kind_is_an_error_that_calls_it_no_parameter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _with(monkeypatch, {"stray": torch.ones(3)})
    with pytest.raises(CheckpointError) as info:
        read_deepspeed_checkpoint(str(DATA / "alias_stage3_fp32"))
    assert "module entry 'stray' (3 elements)" in str(info.value)
    assert "buffer_names" in str(info.value) and "parameter 'stray'" not in str(info.value)


@pytest.mark.parametrize("name", NAMES)
def test_extra_state_is_refused_naming_the_entry(name: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A module's get_extra_state() (TransformerEngine's fp8 metadata) is in
    DeepSpeed's module dict; dsrun's checkpoints hold tensors only."""
    _with(monkeypatch, {"fc1._extra_state": {"fp8": 1}})
    with pytest.raises(from_deepspeed.UnsupportedCheckpoint) as info:
        read_deepspeed_checkpoint(str(DATA / name))
    assert "module entry 'fc1._extra_state' is a dict, not a tensor" in str(info.value)
    assert "get_extra_state()" in str(info.value) and "damaged" not in str(info.value)


def test_a_placeholder_of_no_unique_match_is_left_out_and_named_where_it_is_missing(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
        ) -> None:
    # "copy" looks like fc1, block.lin and fc3 alike: which it is, is unknown
    _with(monkeypatch, {"copy.weight": torch.empty(0), "copy.bias": torch.empty(0)})
    with caplog.at_level("WARNING", logger="dsrun.runtime.checkpoint"):
        import_deepspeed_checkpoint(str(DATA / "alias_stage3_fp32"), str(tmp_path / "out"))
    assert "left out 'copy.weight', 'copy.bias'" in caplog.text
    assert "lacks them" in caplog.text and "strict=False" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="dsrun.runtime.checkpoint"):
        got = get_fp32_state_dict(str(tmp_path / "out"))
    assert "the state dict lacks 'copy.weight', 'copy.bias'" in caplog.text
    assert "copy.weight" not in got and "also.lin.weight" in got
    info = checkpoint_info(str(tmp_path / "out")).selected.summary()
    assert info["unplaced_aliases"] == ["copy.weight", "copy.bias"]
    # what the warnings say: a strict load misses them, strict=False takes the tie
    model = make_alias.build()
    model.copy = model.fc1
    with pytest.raises(RuntimeError, match="copy.weight"):
        model.load_state_dict(got)
    result = model.load_state_dict(got, strict=False)
    assert sorted(result.missing_keys) == ["copy.bias", "copy.weight"]
    assert not result.unexpected_keys
    assert torch.equal(model.state_dict()["copy.weight"], got["fc1.weight"])


def test_an_ambiguous_alias_over_hundreds_of_entries_is_settled_fast() -> None:
    """Two identical towers and a second name of one (``enc`` = ``q``), all
    stage-3 placeholders: nothing tells the towers apart. Each module path
    is asked once, not once per placeholder under it (it took 5.7 s)."""
    from dsrun.runtime.checkpoint.from_deepspeed_aliases import module_aliases

    module, held = {}, []
    for tower in ("q", "k", "enc"):
        for layer in range(16):
            for sub in ("attn.qkv", "attn.out", "mlp.fc", "mlp.proj", "ln1", "ln2"):
                for leaf in ("weight", "bias"):
                    name = f"{tower}.layers.{layer}.{sub}.{leaf}"
                    module[name] = torch.empty(0)
                    if tower != "enc":
                        held.append(name)
    assert len(module) == 576
    start = time.perf_counter()
    assert module_aliases(module, {}, held, [], 3) == {}
    assert time.perf_counter() - start < 1.0
    module["enc.layers.0.ln1.weight"] = module["q.layers.0.ln1.weight"] = torch.ones(2)
    held.remove("q.layers.0.ln1.weight")  # a shared buffer now tells q from k
    found = module_aliases(module, {}, held, ["q.layers.0.ln1.weight"], 3)
    assert found["enc.layers.15.mlp.fc.bias"] == "q.layers.15.mlp.fc.bias"
    assert len(found) == 192


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
