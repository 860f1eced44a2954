"""Checkpoints at world size 1, in this process: bad input, corruption,
disk full, async saves, module-only loads, 16-bit models.

Every failing load must leave the engine exactly as it was (parameters and
optimizer state compared before and after).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import threading
import time
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

import dsrun
from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint import storage
from dsrun.runtime.checkpoint.consolidate import get_fp32_state_dict

pytestmark = pytest.mark.dist


class Small(torch.nn.Module):
    def __init__(self, hidden: int = 6, extra: bool = False) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, hidden)
        self.b = torch.nn.Linear(hidden, 3)
        self.frozen = torch.nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        if extra:
            self.c = torch.nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return self.b(torch.tanh(self.a(x)) * self.frozen).square().mean()


def engine_for(stage: int = 0, seed: int = 0, model: Any = None, **config: Any) -> Any:
    torch.manual_seed(seed)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
           "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
           "zero_optimization": {"stage": stage}, **config}
    engine, *_ = dsrun.initialize(model=model or Small(), config=cfg)
    return engine


def train(engine: Any, steps: int = 2, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        loss = engine(torch.randn(2, 4, generator=gen))
        engine.backward(loss)
        engine.step()


def snapshot(engine: Any) -> dict[str, Any]:
    """Parameters, buffers and optimizer state, cloned."""
    state = {f"p:{k}": v.detach().clone() for k, v in engine.module.state_dict().items()}
    opt = engine.optimizer.optimizer if engine.zero_stage else engine.optimizer
    for i, s in enumerate(opt.state.values()):
        for key, value in s.items():
            state[f"o:{i}:{key}"] = value.detach().clone()
    state["steps"] = engine.global_steps
    return state


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        same = torch.equal(a[key], b[key]) if isinstance(a[key], torch.Tensor) else a[key] == b[key]
        assert same, key


@pytest.fixture
def saved(solo: None, tmp_path: Path) -> tuple[Any, Path]:
    engine = engine_for(stage=1)
    train(engine)
    engine.save_checkpoint(tmp_path, client_state={"k": 1})
    return engine, tmp_path


# ------------------------------------------------------------- bad input


def test_missing_directory_is_an_error_when_a_tag_is_asked_for(
        solo: None, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine = engine_for()
    before = snapshot(engine)
    with pytest.raises(CheckpointError, match="does not exist"):
        engine.load_checkpoint(tmp_path / "nowhere", tag="global_step1")
    (tmp_path / "afile").write_text("")
    with pytest.raises(CheckpointError, match="afile is not a directory"):
        engine.load_checkpoint(tmp_path / "afile")
    # no tag: a resume-if-possible before the first save loads nothing, as DeepSpeed
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime.checkpoint"):
        assert engine.load_checkpoint(tmp_path / "nowhere") == (None, None)
    assert "(the directory does not exist): nothing loaded" in caplog.text
    assert_same(before, snapshot(engine))


def test_no_latest_and_no_tag_loads_nothing(solo: None, tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    engine = engine_for()
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime.checkpoint"):
        assert engine.load_checkpoint(tmp_path) == (None, None)
    assert "no 'latest' file" in caplog.text


def test_a_deepspeed_checkpoint_is_named_with_what_to_do(solo: None, tmp_path: Path) -> None:
    engine = engine_for()
    (tmp_path / "global_step4").mkdir()
    (tmp_path / "global_step4" / "mp_rank_00_model_states.pt").write_bytes(b"")
    (tmp_path / "latest").write_text("global_step4")
    with pytest.raises(CheckpointError, match="is a DeepSpeed checkpoint, which dsrun does "
                                              "not read: .* zero_to_fp32.py"):
        engine.load_checkpoint(tmp_path)
    from dsrun.runtime.checkpoint.info import checkpoint_info
    with pytest.raises(CheckpointError, match="is a DeepSpeed checkpoint"):
        checkpoint_info(str(tmp_path))


def test_the_save_directory_gets_a_zero_to_fp32_script_as_in_deepspeed(
        saved: tuple[Any, Path], tmp_path_factory: pytest.TempPathFactory) -> None:
    engine, root = saved
    script = root / "zero_to_fp32.py"
    out = tmp_path_factory.mktemp("fp32")
    res = subprocess.run([sys.executable, str(script), str(root), str(out)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    written = torch.load(out / "pytorch_model.bin")
    want = engine.module.state_dict()
    assert written.keys() == want.keys()
    assert all(torch.equal(written[k].to(want[k].dtype), want[k]) for k in want)
    before = script.stat().st_mtime_ns
    engine.save_checkpoint(root, tag="again")  # the same text is left alone
    assert script.stat().st_mtime_ns == before


def test_missing_tag_lists_the_tags_there(saved: tuple[Any, Path]) -> None:
    engine, root = saved
    fresh = engine_for(stage=1, seed=3)
    before = snapshot(fresh)
    with pytest.raises(CheckpointError, match=r"'nope'.*no such tag.*global_step2"):
        fresh.load_checkpoint(root, tag="nope")
    assert_same(before, snapshot(fresh))


def test_an_interrupted_save_is_named(saved: tuple[Any, Path]) -> None:
    _, root = saved
    (root / "global_step9.tmp").mkdir()
    fresh = engine_for(stage=1, seed=3)
    with pytest.raises(CheckpointError, match="save never finished"):
        fresh.load_checkpoint(root, tag="global_step9")


@pytest.mark.parametrize("tag", ["a/b", "latest", "x.tmp", "", ".."])
def test_bad_tags_are_refused(saved: tuple[Any, Path], tag: str) -> None:
    engine, root = saved
    with pytest.raises(CheckpointError, match="tag"):
        engine.save_checkpoint(root, tag=tag)
    assert (root / "latest").read_text() == "global_step2"


@pytest.mark.parametrize("tag", ["\udcff", "step\ud800"])
def test_a_tag_with_a_lone_surrogate_is_refused_naming_it(saved: tuple[Any, Path],
                                                          tag: str) -> None:
    """os.fsdecode() of bytes that are not UTF-8 makes '\\udcff': refused
    before anything is written (not a UnicodeEncodeError at `latest`, after
    the tag's directory was made)."""
    engine, root = saved
    before = sorted(os.listdir(root))
    with pytest.raises(CheckpointError, match=r"the tag '.*' cannot be a directory name: "
                                              r"'\\ud[c8]..' at index \d+ is not a character"):
        engine.save_checkpoint(root, tag=tag)
    assert sorted(os.listdir(root)) == before
    assert (root / "latest").read_text() == "global_step2"


def test_a_tag_too_long_for_the_file_system_is_refused_before_anything_is_written(
        saved: tuple[Any, Path]) -> None:
    """255-byte names: the tag and '.replaced' must fit (the longest fails the
    first save on 'TAG.tmp' without the check, a shorter one the second save
    on 'TAG.replaced')."""
    engine, root = saved
    for tag in ("x" * 247, "x" * 252, "\u00e9" * 124):
        with pytest.raises(CheckpointError, match=f"the tag '{tag}' is "
                           f"{len(tag.encode())} bytes long .*more than the 246"):
            engine.save_checkpoint(root, tag=tag)
    assert sorted(p.name for p in root.iterdir()) == ["global_step2", "latest",
                                                         "zero_to_fp32.py", "zero_to_torch.py"]
    assert (root / "latest").read_text() == "global_step2"
    longest = "x" * 246
    engine.save_checkpoint(root, tag=longest)
    engine.save_checkpoint(root, tag=longest)  # replaced: TAG.replaced fits too
    assert (root / "latest").read_text() == longest
    assert engine_for(stage=1, seed=3).load_checkpoint(root)[0] == str(root / longest)


def test_a_client_state_that_is_not_a_dict_is_refused_before_anything_is_written(
        saved: tuple[Any, Path]) -> None:
    engine, root = saved
    with pytest.raises(CheckpointError, match=r"client_state=\.\.\.\) must be a dict \(a "
                       r"Mapping\), got list \[1, 2\].*nothing was written"):
        engine.save_checkpoint(root, tag="bad", client_state=[1, 2])
    assert sorted(p.name for p in root.iterdir()) == ["global_step2", "latest",
                                                         "zero_to_fp32.py", "zero_to_torch.py"]


def test_a_saved_client_state_that_is_not_a_dict_changes_nothing(
        saved: tuple[Any, Path]) -> None:
    """Such a checkpoint (an earlier dsrun saved it without complaint) is
    refused before the weights or the counters change, whatever is loaded."""
    engine, root = saved
    path = root / "global_step2" / "engine_state.pt"
    state = torch.load(path, weights_only=False)
    state["client_state"] = [1, 2]
    path.write_bytes(b"")
    torch.save(state, path)
    blob = path.read_bytes()
    manifest = json.loads((root / "global_step2" / "manifest.json").read_text())
    manifest["files"]["engine_state.pt"] = {"bytes": len(blob), "crc32": zlib.crc32(blob)}
    (root / "global_step2" / "manifest.json").write_text(json.dumps(manifest))
    fresh = engine_for(stage=1, seed=3)
    train(fresh, 1, seed=7)
    before = snapshot(fresh)
    for how in ({}, {"load_module_only": True}):
        with pytest.raises(CheckpointError, match="its client_state is a list \\[1, 2\\], not a "
                                                  "dict.*to-fp32"):
            fresh.load_checkpoint(root, **how)
        assert_same(before, snapshot(fresh))


def test_names_that_differ_are_listed_and_non_strict_loads_the_rest(
        saved: tuple[Any, Path], caplog: pytest.LogCaptureFixture) -> None:
    engine, root = saved
    other = engine_for(stage=1, seed=3, model=Small(extra=True))
    before = snapshot(other)
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint \(2\): c\.bias, "
                                              r"c\.weight"):
        other.load_checkpoint(root)
    assert_same(before, snapshot(other))
    with caplog.at_level(logging.WARNING, logger="dsrun.runtime.checkpoint"):
        other.load_checkpoint(root, load_module_strict=False)
    assert "skipped missing from the checkpoint (2): c.bias, c.weight" in caplog.text
    assert torch.equal(other.module.a.weight, engine.module.a.weight)
    assert torch.equal(other.module.c.weight, before["p:c.weight"])


def test_shapes_that_differ_are_listed(saved: tuple[Any, Path]) -> None:
    _, root = saved
    other = engine_for(stage=1, seed=3, model=Small(hidden=7))
    before = snapshot(other)
    with pytest.raises(CheckpointError, match=r"different shapes \(4\): a\.bias: checkpoint "
                                              r"\[6\] vs model \[7\]"):
        other.load_checkpoint(root)
    assert_same(before, snapshot(other))


def test_an_incompatible_format_version_is_an_error(saved: tuple[Any, Path]) -> None:
    _, root = saved
    manifest = root / "global_step2" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["version"] = 99
    manifest.write_text(json.dumps(data))
    fresh = engine_for(stage=1, seed=3)
    before = snapshot(fresh)
    with pytest.raises(CheckpointError, match="format version 99"):
        fresh.load_checkpoint(root)
    assert_same(before, snapshot(fresh))


def test_another_optimizer_needs_load_optimizer_states_false(saved: tuple[Any, Path]) -> None:
    engine, root = saved
    sgd = engine_for(stage=1, seed=3, optimizer={"type": "SGD", "params": {"lr": 0.1}})
    with pytest.raises(CheckpointError, match="AdamW's, this engine's optimizer is SGD"):
        sgd.load_checkpoint(root)
    sgd.load_checkpoint(root, load_optimizer_states=False)
    assert torch.equal(sgd.module.b.weight, engine.module.b.weight)


# -------------------------------------------------------- corrupt files


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete", "manifest"])
def test_a_damaged_file_is_named_and_nothing_is_loaded(saved: tuple[Any, Path],
                                                       damage: str) -> None:
    _, root = saved
    tag = root / "global_step2"
    data = tag / "rank_00000.bin"
    if damage == "corrupt":
        flip_byte(data, data.stat().st_size // 2)
        expected = r"rank_00000\.bin is corrupt: the checksum of tensor"
    elif damage == "truncate":
        os.truncate(data, data.stat().st_size - 5)
        expected = r"rank_00000\.bin is truncated"
    elif damage == "delete":
        data.unlink()
        expected = r"rank_00000\.bin is missing"
    else:
        (tag / "manifest.json").write_text("{not json")
        expected = r"manifest\.json: not valid JSON"
    fresh = engine_for(stage=1, seed=3)
    before = snapshot(fresh)
    with pytest.raises(CheckpointError, match=expected):
        fresh.load_checkpoint(root)
    assert_same(before, snapshot(fresh))


def test_a_corrupt_engine_state_is_named(saved: tuple[Any, Path]) -> None:
    _, root = saved
    flip_byte(root / "global_step2" / "engine_state.pt", 40)
    with pytest.raises(CheckpointError, match=r"engine_state\.pt is corrupt"):
        engine_for(stage=1, seed=3).load_checkpoint(root)


# ----------------------------------------------------------- disk full


def test_disk_full_is_a_clear_error_and_the_previous_checkpoint_survives(
        saved: tuple[Any, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    engine, root = saved
    real = storage.write_all

    def full_after_first(fd: int, data: memoryview) -> None:
        if os.fstat(fd).st_size > 0:
            raise storage.WriteFailed(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), 0)
        real(fd, data)

    monkeypatch.setattr(storage, "write_all", full_after_first)
    train(engine)
    with pytest.raises(CheckpointError, match="no space left on the device writing .*"
                                              r"rank_00000\.bin.*previous checkpoint is intact"):
        engine.save_checkpoint(root)
    monkeypatch.setattr(storage, "write_all", real)
    assert (root / "latest").read_text() == "global_step2"
    assert sorted(p.name for p in root.iterdir()) == ["global_step2", "latest",
                                                         "zero_to_fp32.py", "zero_to_torch.py"]
    fresh = engine_for(stage=1, seed=3)
    assert fresh.load_checkpoint(root)[0] == str(root / "global_step2")


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Any:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                         capture_output=True, text=True)
    if res.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_real_full_file_system_refuses_before_writing(solo: None, small_tmpfs: Path) -> None:
    engine = engine_for(stage=0)
    train(engine)
    engine.save_checkpoint(small_tmpfs)
    big = engine_for(stage=0, seed=1, model=Small(hidden=4000))
    train(big)
    with pytest.raises(CheckpointError, match=r"not enough space .* needs [\d.]+ KiB \([\d.]+ KiB "
                                              r"of data \+ 2% .*\), [\d.]+ KiB are free"):
        big.save_checkpoint(small_tmpfs)
    assert (small_tmpfs / "latest").read_text() == "global_step2"
    assert sorted(p.name for p in small_tmpfs.iterdir()) == [
        "global_step2", "latest", "zero_to_fp32.py", "zero_to_torch.py"]
    assert engine_for(stage=0, seed=2).load_checkpoint(small_tmpfs)[0]


# --------------------------------------------------------------- async


def test_training_continues_during_an_async_save(solo: None, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The background write is held halfway (test pause point) while the
    engine trains two more steps; once released, the checkpoint equals a
    synchronous save of the state at the call."""
    release, mark = tmp_path / "release", tmp_path / "paused"
    paused = engine_for(stage=2, checkpoint={"async": True})
    reference = engine_for(stage=2)
    train(paused)
    train(reference)
    monkeypatch.setenv("DSRUN_CHECKPOINT_TEST_PAUSE", "0:write")
    monkeypatch.setenv("DSRUN_CHECKPOINT_TEST_PAUSE_MARK", str(mark))
    monkeypatch.setenv("DSRUN_CHECKPOINT_TEST_RELEASE", str(release))
    paused.save_checkpoint(tmp_path / "async", tag="t")
    monkeypatch.delenv("DSRUN_CHECKPOINT_TEST_PAUSE")
    deadline = time.monotonic() + 30
    while not mark.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert mark.exists() and paused._checkpointer.saver.in_flight
    train(paused, 2, seed=5)  # the save is still being written
    assert not (tmp_path / "async" / "latest").exists()
    assert not torch.equal(paused.module.a.weight, reference.module.a.weight)
    reference.save_checkpoint(tmp_path / "sync", tag="t")
    release.touch()
    paused.destroy()  # waits for the save
    assert (tmp_path / "async" / "t" / "rank_00000.bin").read_bytes() == \
        (tmp_path / "sync" / "t" / "rank_00000.bin").read_bytes()
    states = [torch.load(tmp_path / d / "t" / "engine_state.pt", weights_only=False)
              for d in ("async", "sync")]
    configs = [state.pop("ds_config") for state in states]  # the engines' configs differ
    assert configs[0]["checkpoint"]["async"] and not configs[1]["checkpoint"]["async"]
    assert states[0] == states[1]
    manifests = [json.loads((tmp_path / d / "t" / "manifest.json").read_text())["tensors"]
                 for d in ("async", "sync")]
    assert manifests[0] == manifests[1]
    assert (tmp_path / "async" / "latest").read_text() == "t"


def test_the_next_step_waits_until_an_async_save_has_copied_the_state(
        solo: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The background copy is held (test pause point) for 0.5 s: forward
    and backward run, the optimizer step waits, and the checkpoint holds
    the state of the call, not the updated one."""
    release = tmp_path / "release"
    monkeypatch.setenv("DSRUN_CHECKPOINT_TEST_PAUSE", "0:stage")
    monkeypatch.setenv("DSRUN_CHECKPOINT_TEST_RELEASE", str(release))
    engine = engine_for(stage=3, checkpoint={"async": True})
    train(engine)
    expected = {k: v.clone() for k, v in engine.optimizer.module_state_dict().items()}
    engine.save_checkpoint(tmp_path, tag="t")
    monkeypatch.delenv("DSRUN_CHECKPOINT_TEST_PAUSE")
    threading.Timer(0.5, release.touch).start()
    start = time.monotonic()
    train(engine, 1, seed=3)
    assert time.monotonic() - start >= 0.45
    engine.wait_for_checkpoint()
    saved = get_fp32_state_dict(str(tmp_path))
    assert not torch.equal(engine.module.a.weight.ds_tensor, expected["a.weight"].view(-1))
    assert all(torch.equal(saved[k], expected[k].float()) for k in expected)


def test_async_failures_are_raised_by_the_next_save_and_by_destroy(
        solo: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engine_for(stage=2, checkpoint={"async": True})
    train(engine)
    real = storage.write_all

    def disk_full(fd: int, data: memoryview) -> None:
        raise storage.WriteFailed(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), 0)

    monkeypatch.setattr(storage, "write_all", disk_full)
    engine.save_checkpoint(tmp_path, tag="doomed")  # returns: the write is in the background
    with pytest.raises(CheckpointError, match=r"^no space left .*doomed\.tmp/rank_00000\.bin"
                                              r".*\(the asynchronous save of tag 'doomed' "
                                              r"failed on rank 0\)$"):
        engine.save_checkpoint(tmp_path, tag="next")
    monkeypatch.setattr(storage, "write_all", real)
    engine.save_checkpoint(tmp_path, tag="next")  # the error was raised once; this one works
    engine.wait_for_checkpoint()
    monkeypatch.setattr(storage, "write_all", disk_full)
    engine.save_checkpoint(tmp_path, tag="doomed2")
    with pytest.raises(CheckpointError, match="'doomed2' failed"):
        engine.destroy()
    monkeypatch.setattr(storage, "write_all", real)
    assert (tmp_path / "latest").read_text() == "next"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "next", "zero_to_fp32.py",
                                                          "zero_to_torch.py"]


# ------------------------------------------------------- what is loaded


def test_module_only_and_no_optimizer_state(saved: tuple[Any, Path]) -> None:
    engine, root = saved
    fresh = engine_for(stage=2, seed=3)
    train(fresh, 1, seed=7)
    opt_before = snapshot(fresh)
    path, client = fresh.load_checkpoint(root, load_module_only=True)
    # DeepSpeed hands back the counters that a module-only load leaves alone
    assert path and {k: client[k] for k in ("k", "global_steps", "skipped_steps",
                                            "global_samples", "dp_world_size",
                                            "mp_world_size")} == {
        "k": 1, "global_steps": 2, "skipped_steps": 0, "global_samples": engine.global_samples,
        "dp_world_size": 1, "mp_world_size": 1}
    assert torch.equal(fresh.module.a.weight, engine.module.a.weight)
    assert fresh.global_steps == 1  # counters are not loaded with the module only
    after = snapshot(fresh)
    assert all(torch.equal(after[k], opt_before[k]) for k in after if k.startswith("o:"))
    _, client = fresh.load_checkpoint(root, load_optimizer_states=False)
    assert client["k"] == 1 and client["global_samples"] == engine.global_samples
    assert "global_steps" not in client and "dp_world_size" not in client
    assert fresh.global_steps == 2
    assert all(torch.equal(snapshot(fresh)[k], opt_before[k]) for k in after if k.startswith("o:"))


def test_the_client_state_comes_back_with_deepspeeds_keys(solo: None, tmp_path: Path) -> None:
    """The keys and values DeepSpeed 0.19.8's load_checkpoint returns for
    this model saved at stage 2 (its own config and version aside)."""
    import deepspeed

    engine = engine_for(stage=2)
    train(engine)
    engine.save_checkpoint(tmp_path, client_state={"k": 1, "ds_version": "mine"})
    fresh = engine_for(stage=0, seed=3)
    _, client = fresh.load_checkpoint(tmp_path)
    assert client == {
        "buffer_names": ["count"],
        "param_shapes": [OrderedDict([("a.weight", torch.Size([6, 4])),
                                      ("a.bias", torch.Size([6])),
                                      ("b.weight", torch.Size([3, 6])),
                                      ("b.bias", torch.Size([3]))])],
        "frozen_param_shapes": OrderedDict([("frozen", torch.Size([6]))]),
        "shared_params": {}, "global_samples": 4,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
        "ds_config": engine.config.to_dict(), "ds_version": "mine", "k": 1}
    engine.save_checkpoint(tmp_path, tag="plain")
    _, client = fresh.load_checkpoint(tmp_path, tag="plain")
    assert client["ds_version"] == deepspeed.__version__ == dsrun.__version__
    assert client["ds_config"]["zero_optimization"]["stage"] == 2  # the saving engine's
    assert client["ds_config"]["train_batch_size"] == 2


def test_the_saved_and_returned_config_hold_no_secrets(solo: None, tmp_path: Path) -> None:
    """Checkpoints get shared: comet.api_key is saved, and handed back, redacted."""
    engine = engine_for(stage=1, comet={"enabled": False, "api_key": "SECRET123",
                                        "project": "p"})
    assert engine.config.to_dict()["comet"]["api_key"] == "SECRET123"
    train(engine)
    engine.save_checkpoint(tmp_path, tag="t")
    blob = (tmp_path / "t" / "engine_state.pt").read_bytes()
    assert b"SECRET123" not in blob
    saved = torch.load(tmp_path / "t" / "engine_state.pt", weights_only=False)["ds_config"]
    assert saved["comet"] == {**engine.config.to_dict()["comet"], "api_key": "<redacted>"}
    _, client = engine_for(stage=1, seed=3).load_checkpoint(tmp_path)
    assert client["ds_config"] == saved


def test_same_tag_saved_twice_and_save_latest_false(saved: tuple[Any, Path]) -> None:
    engine, root = saved
    train(engine)
    engine.save_checkpoint(root, tag="global_step2")  # overwritten in place
    engine.save_checkpoint(root, tag="side", save_latest=False)
    assert (root / "latest").read_text() == "global_step2"
    assert sorted(p.name for p in root.iterdir()) == ["global_step2", "latest", "side",
                                                         "zero_to_fp32.py", "zero_to_torch.py"]
    state = get_fp32_state_dict(str(root))
    assert torch.equal(state["a.weight"], engine.module.a.weight)


def test_exclude_frozen_parameters(solo: None, tmp_path: Path,
                                   caplog: pytest.LogCaptureFixture) -> None:
    """As DeepSpeed ("Missing key(s) in state_dict"), a strict load refuses
    the frozen parameters the save left out, naming them; a non-strict one
    keeps the model's own values for them."""
    engine = engine_for(stage=3)
    with torch.no_grad():
        engine.module.frozen.fill_(2.0)
    train(engine)
    engine.save_checkpoint(tmp_path, exclude_frozen_parameters=True)
    manifest = json.loads((tmp_path / "global_step2" / "manifest.json").read_text())
    assert "frozen" not in manifest["tensors"] and manifest["meta"]["excluded_frozen"] == ["frozen"]
    fresh = engine_for(stage=3, seed=4)
    before = snapshot(fresh)
    with pytest.raises(CheckpointError, match=r"missing from the checkpoint \(1\): frozen \(all "
                       r"frozen when saved and left out by save_checkpoint\("
                       r"exclude_frozen_parameters=True\)\)\. Pass load_module_strict=False"):
        fresh.load_checkpoint(tmp_path)
    assert_same(before, snapshot(fresh))
    with caplog.at_level(logging.INFO, logger="dsrun.runtime.checkpoint"):
        path, client = fresh.load_checkpoint(tmp_path, load_module_strict=False)
    assert path and client["frozen_param_shapes"] is None  # as DeepSpeed's
    assert "load_module_strict=False: skipped missing from the checkpoint (1): frozen" \
        in caplog.text
    assert torch.equal(fresh.module.frozen, before["p:frozen"])  # its own value, not 2.0
    assert torch.equal(fresh.module.a.weight, engine.module.a.weight)
    assert fresh.global_steps == 2


def test_fp16_loss_scale_and_masters_round_trip(solo: None, tmp_path: Path) -> None:
    cfg = {"fp16": {"enabled": True, "auto_cast": True, "initial_scale_power": 8,
                    "loss_scale_window": 2}}
    engine = engine_for(stage=0, **cfg)
    train(engine, 5)
    engine.save_checkpoint(tmp_path)
    fresh = engine_for(stage=0, seed=9, **cfg)
    fresh.load_checkpoint(tmp_path)
    assert fresh.precision.loss_scale == engine.precision.loss_scale != 2.0**8
    assert fresh.precision.scaler.state_dict() == engine.precision.scaler.state_dict()
    assert all(torch.equal(a, b) for a, b in zip(fresh.precision.masters,
                                                  engine.precision.masters))
    assert fresh.module.a.weight.dtype == torch.float16
    assert torch.equal(fresh.module.a.weight, engine.module.a.weight)
    # as in DeepSpeed, the scaler is part of the optimizer's state
    other = engine_for(stage=0, seed=9, **cfg)
    other.load_checkpoint(tmp_path, load_optimizer_states=False)
    assert other.precision.loss_scale == 2.0**8
    assert other.global_steps == engine.global_steps


@pytest.mark.parametrize("precision, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16),
                                              (None, torch.float32)])
def test_save_16bit_model(solo: None, tmp_path: Path, precision: Any, dtype: Any) -> None:
    cfg = {precision: {"enabled": True, "auto_cast": True} if precision == "fp16" else
           {"enabled": True}} if precision else {}
    engine = engine_for(stage=2, **cfg)
    train(engine)
    assert engine.save_16bit_model(tmp_path) is True
    saved = torch.load(tmp_path / "pytorch_model.bin")
    assert list(saved) == list(engine.module.state_dict())
    assert saved["a.weight"].dtype == dtype and saved["count"].dtype == torch.long
    assert torch.equal(saved["a.weight"], engine.module.a.weight.detach().to(dtype))


def test_save_16bit_model_at_stage3_needs_the_gather_flag(solo: None, tmp_path: Path) -> None:
    engine = engine_for(stage=3)
    assert engine.save_16bit_model(tmp_path) is False
    assert not (tmp_path / "pytorch_model.bin").exists()


def test_deepspeeds_16bit_model_api(solo: None, tmp_path: Path) -> None:
    """What Hugging Face Trainer and Accelerate call to save ZeRO-3 models."""
    engine = engine_for(stage=3, zero_optimization={
        "stage": 3, "stage3_gather_16bit_weights_on_model_save": True})
    assert engine.zero_gather_16bit_weights_on_model_save() is True
    assert engine.loaded_checkpoint_dp_world_size is None
    assert engine.loaded_checkpoint_mp_world_size is None
    assert not engine.load_universal_checkpoint() and not engine.use_node_local_storage()
    assert engine.zero_load_from_fp32_weights()  # DeepSpeed's defaults
    train(engine)
    full = engine.optimizer.module_state_dict()
    state = engine._zero3_consolidated_16bit_state_dict()
    assert list(state) == list(full) and all(torch.equal(state[k], full[k]) for k in full)
    assert "frozen" not in engine._zero3_consolidated_16bit_state_dict(
        exclude_frozen_parameters=True)
    assert engine.save_fp16_model(tmp_path, "m.bin") is True
    saved = torch.load(tmp_path / "m.bin")
    assert list(saved) == list(full) and all(torch.equal(saved[k], full[k]) for k in full)
    engine.save_checkpoint(tmp_path / "ckpt")
    fresh = engine_for(stage=1)
    assert fresh.zero_gather_16bit_weights_on_model_save() is False
    with pytest.raises(ValueError, match="requires ZeRO stage 3"):
        fresh._zero3_consolidated_16bit_state_dict()
    fresh.load_checkpoint(tmp_path / "ckpt")
    assert fresh.loaded_checkpoint_dp_world_size == fresh.loaded_checkpoint_mp_world_size == 1
    flags = engine_for(checkpoint={"load_universal": True, "use_node_local_storage": True},
                       zero_optimization={"stage": 1, "load_from_fp32_weights": False})
    assert flags.load_universal_checkpoint() and flags.use_node_local_storage()
    assert not flags.zero_load_from_fp32_weights()
