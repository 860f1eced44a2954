"""Writer, reader, consolidation and info through the Python API, in this
process without a process group (world size 1), with a hand-made state
source: what the fragments interface promises, checked from the outside."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint import storage, writer
from dsrun.runtime.checkpoint.async_save import AsyncSaver
from dsrun.runtime.checkpoint.consolidate import get_fp32_state_dict, to_fp32
from dsrun.runtime.checkpoint.coord import (
    Coordinator,
    Failure,
    SaveBoard,
    check_same,
    raise_failures,
    raise_first,
)
from dsrun.runtime.checkpoint.fragments import (
    ExportedState,
    Fragment,
    ImportPlan,
    LoadTarget,
    TensorInfo,
    install_state,
    split_state,
)
from dsrun.runtime.checkpoint.info import checkpoint_info, format_info, human_bytes, size_texts
from dsrun.runtime.checkpoint.manifest import SAVE_ID
from dsrun.runtime.checkpoint.reader import LoadRequest, load_state
from dsrun.runtime.checkpoint.stateformats import SafetensorsWriter, Spec, TorchSaveWriter
from dsrun.runtime.checkpoint.tags import remove_stale_saves
from dsrun.runtime.checkpoint.writer import (
    Commit,
    RankFailed,
    RankPlan,
    RankWrite,
    SaveRequest,
    own_share,
    save_state,
)


class DictSource:
    """Tensors by name, each saved as ``parts`` fragments (as if sharded)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], parts: int = 1,
                 replicated: bool = False, replica: tuple[int, int] = (0, 1)) -> None:
        self.tensors = dict(tensors)
        self.parts, self.replicated, self.replica = parts, replicated, replica

    def _infos(self) -> dict[str, TensorInfo]:
        return {n: TensorInfo(n, tuple(t.shape), t.dtype, "param", 0)
                for n, t in self.tensors.items()}

    def export_state(self, names: Mapping[int, str]) -> ExportedState:
        frags = []
        for name, t in self.tensors.items():
            flat = t.reshape(-1)
            bounds = sorted({0, flat.numel(), *(flat.numel() * k // self.parts
                                                for k in range(self.parts))})
            for a, b in zip(bounds, bounds[1:]):
                frags.append(Fragment(name, a, b, flat[a:b], {"m": flat[a:b] * 2},
                                      {"step": torch.tensor(5.0)}, self.replicated))
        return ExportedState(self._infos(), tuple(frags), ({"lr": 0.5},), "Fake", self.replica)

    def prepare_import(self, names: Mapping[int, str],
                       state_keys: Optional[Sequence[str]]) -> ImportPlan:
        targets = [LoadTarget(n, 0, t.numel(), torch.zeros(t.numel(), dtype=t.dtype),
                              {k: torch.zeros(t.numel()) for k in state_keys or ()})
                   for n, t in self.tensors.items()]
        return ImportPlan(self._infos(), targets, "Fake")

    def finish_import(self, plan: ImportPlan, groups: Any, optimizer_states: bool) -> None:
        self.loaded = {t.name: t for t in plan.targets if t.loaded}
        self.groups = groups


def tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(5, 7, generator=gen), "b": torch.randn(13, generator=gen),
            "half": torch.randn(4, generator=gen).to(torch.bfloat16)}


def save(root: Path, source: Any, tag: str = "t", **kw: Any) -> str:
    request = SaveRequest(str(root), tag, meta={"zero_stage": 2, "global_steps": 4}, **kw)
    return save_state(request, [source.export_state({})], Coordinator(5))


def test_save_then_load_restores_values_state_and_scalars(tmp_path: Path) -> None:
    source = DictSource(tensors(), parts=3)
    assert save(tmp_path, source) == str(tmp_path / "t")
    assert (tmp_path / "latest").read_text() == "t"
    target = DictSource({n: torch.zeros_like(t) for n, t in tensors().items()})
    loaded = load_state(LoadRequest(str(tmp_path)), [target], {}, Coordinator(5))
    assert loaded is not None and loaded.path == str(tmp_path / "t")
    for name, t in tensors().items():
        got = target.loaded[name]
        assert torch.equal(got.value, t.reshape(-1))
        assert torch.equal(got.state["m"], (t.reshape(-1) * 2).float())
        assert got.scalars["step"].item() == 5.0
    assert target.groups == [{"lr": 0.5}]


def test_fsync_false_never_fsyncs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_fsync(fd: int) -> None:
        raise AssertionError("fsync called")

    monkeypatch.setattr(os, "fsync", no_fsync)
    save(tmp_path, DictSource(tensors()), durable=False)
    target = DictSource(tensors())
    load_state(LoadRequest(str(tmp_path)), [target], {}, Coordinator(5))
    assert torch.equal(target.loaded["b"].value, tensors()["b"])
    with pytest.raises(CheckpointError, match="AssertionError: fsync called"):
        save(tmp_path, DictSource(tensors()), tag="durable")


def test_loading_without_optimizer_state_reads_no_state(tmp_path: Path) -> None:
    save(tmp_path, DictSource(tensors()))
    target = DictSource(tensors())
    load_state(LoadRequest(str(tmp_path), optimizer_states=False), [target], {}, Coordinator(5))
    assert all(not t.state for t in target.loaded.values()) and target.groups is None


@given(st.integers(1, 60), st.integers(1, 5), st.lists(st.integers(0, 40), min_size=1,
                                                        max_size=4))
@settings(max_examples=100, deadline=None)
def test_replicated_fragments_are_written_once_across_replicas(_: int, count: int,
                                                               sizes: list[int]) -> None:
    frags = [Fragment(f"t{i}", 0, n, torch.zeros(n), replicated=True)
             for i, n in enumerate(sizes) if n]
    seen: dict[str, list[tuple[int, int]]] = {}
    for index in range(count):
        export = ExportedState({f.name: TensorInfo(f.name, (f.end,), torch.float32)
                                for f in frags}, tuple(frags), replica=(index, count))
        for frag in own_share(export):
            seen.setdefault(frag.name, []).append((frag.start, frag.end))
    for frag in frags:
        ranges = sorted(seen[frag.name])
        assert ranges[0][0] == 0 and ranges[-1][1] == frag.end
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_a_full_disk_names_the_file_and_keeps_the_previous_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save(tmp_path, DictSource(tensors()), tag="old")

    def full(fd: int, data: memoryview) -> None:
        raise storage.WriteFailed(OSError(errno.ENOSPC, "No space left on device"), 0)

    monkeypatch.setattr(storage, "write_all", full)
    with pytest.raises(CheckpointError, match=r"no space left .*new\.tmp/rank_00000\.bin.*"
                                              "previous checkpoint is intact"):
        save(tmp_path, DictSource(tensors()), tag="new")
    assert sorted(os.listdir(tmp_path)) == ["latest", "old", "zero_to_fp32.py", "zero_to_torch.py"]
    assert (tmp_path / "latest").read_text() == "old"


def test_a_write_failing_midway_says_how_much_was_written_before(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, data: memoryview) -> None:
        os.write(fd, data[:40])
        raise storage.WriteFailed(OSError(errno.ENOSPC, "No space left on device"), 40)

    monkeypatch.setattr(storage, "write_all", full)
    with pytest.raises(CheckpointError) as caught:
        save(tmp_path, DictSource(tensors()), tag="new")
    text = str(caught.value)
    assert "(No space left on device; 40 bytes of this rank's 400 bytes were written before " \
           "the write failed)" in text, text
    assert size_texts(400 << 10, 410 << 10) == ["400.0 KiB", "410.0 KiB"]
    assert size_texts(5 << 20, 5 << 20) == ["5.0 MiB", "5.0 MiB"]
    assert size_texts(2**20, 2**20 + 1) == ["1.000000 MiB", "1.000001 MiB"]
    assert size_texts(2**20, 2**20 + 2**11) == ["1.000 MiB", "1.002 MiB"]
    assert [human_bytes(n) for n in (512, 1536, 3 << 30)] == ["512 bytes", "1.5 KiB", "3.0 GiB"]


def test_the_space_check_shows_its_margin_and_different_numbers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer, "free_bytes", lambda _path: 405)  # data: 400 bytes
    with pytest.raises(CheckpointError) as caught:
        save(tmp_path, DictSource(tensors()), tag="t")
    text = str(caught.value)
    assert "needs 408 bytes (400 bytes of data + 2% for records and file-system " \
           "overhead), 405 bytes are free" in text, text
    assert not (tmp_path / "t.tmp").exists()


class TwoRanks(Coordinator):
    """Rank 0 of two, rank 1 posting ``other`` (its problem) in the agreement;
    records the agreements and exchanges."""

    def __init__(self, other: Optional[str]) -> None:
        super().__init__(5)
        self.world, self.other, self.calls = 2, other, []

    def agree(self, what: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
        self.calls.append(("agree", payload))
        return [payload, {**payload, "problem": self.other}]

    def exchange(self, obj: Any) -> list[Any]:
        self.calls.append(("exchange", obj))
        return [obj, None]


@pytest.mark.parametrize("async_", [False, True])
def test_a_save_another_rank_refuses_changes_nothing_on_disk(tmp_path: Path,
                                                            async_: bool) -> None:
    """Rank 0 removes a stale TAG.tmp/ and makes the save directory only once
    every rank agreed to save: not for a bad argument on rank 1."""
    (tmp_path / "t.tmp").mkdir()
    (tmp_path / "t.tmp" / "rank_00000.bin").write_bytes(b"old")
    for save_dir in (tmp_path, tmp_path / "new"):
        request = SaveRequest(str(save_dir), "t")
        coord = TwoRanks("client_state is a list (nothing was written)")
        with pytest.raises(CheckpointError, match=r"failed on rank 1: client_state is a list"):
            (writer.begin_save if async_ else save_state)(request, [], coord)
        assert [c[0] for c in coord.calls] == ["agree"]
        assert sorted(os.listdir(tmp_path)) == ["t.tmp"]
        assert os.listdir(tmp_path / "t.tmp") == ["rank_00000.bin"]
    coord = TwoRanks(None)
    write, _ = writer.begin_save(SaveRequest(str(tmp_path / "new"), "t"),
                                 [DictSource(tensors()).export_state({})], coord)
    # rank 0's room was made (with this save's id in TAG.tmp/), then every
    # rank said whether it sees it: every rank may write
    assert [c[0] for c in coord.calls] == ["agree", "exchange", "exchange"]
    assert coord.calls[1][1][0] is None and coord.calls[2][1] is None
    assert sorted(os.listdir(tmp_path)) == ["new", "t.tmp"]
    assert os.listdir(tmp_path / "new" / "t.tmp") == [SAVE_ID]
    (tmp_path / "new" / "t.tmp" / "rank_00000.bin").write_bytes(b"old")
    writer.begin_save(SaveRequest(str(tmp_path / "new"), "t"), [], TwoRanks(None))
    assert os.listdir(tmp_path / "new" / "t.tmp") == [SAVE_ID]  # the stale save is gone


def test_rank_0s_space_check_is_raised_on_every_rank_as_it_is(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer, "free_bytes", lambda _path: 10)
    coord = TwoRanks(None)
    with pytest.raises(CheckpointError, match=r"^not enough space in .*new for checkpoint 't'"):
        writer.begin_save(SaveRequest(str(tmp_path / "new"), "t"),
                          [DictSource(tensors()).export_state({})], coord)
    assert coord.calls[1][0] == "exchange" and "not enough space" in coord.calls[1][1][0]
    assert not os.listdir(tmp_path)  # the save directory is not made either
    monkeypatch.undo()
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match=r"cannot save checkpoint 't' in .*file/new: "
                                              r"\[Errno 20\] Not a directory"):
        save(tmp_path / "file" / "new", DictSource(tensors()))


def board(world: int = 3) -> SaveBoard:
    return SaveBoard(torch.distributed.HashStore(), "dsrun/checkpoint/7/failed/", world)


def test_the_board_reports_the_first_failure_first_hand_before_consequences() -> None:
    shared = board()
    assert shared.first() is None and shared.posted() == {}
    shared.post(Failure(2, "rank 2 stopped: rank 1's error", cause=False))
    shared.post(Failure(1, "no space left on the device writing x/rank_00001.bin"))
    other = SaveBoard(shared.store, shared.prefix, 3)  # another rank's view
    assert other.first() == Failure(1, "no space left on the device writing x/rank_00001.bin")
    assert other.first([2]) == Failure(2, "rank 2 stopped: rank 1's error", False)
    assert other.first([0]) is None


def commit_of(root: Path, world: int = 3) -> Commit:
    return Commit(str(root), "t", world, {}, {}, True)


def test_a_posted_failure_ends_the_commits_wait_at_once(tmp_path: Path) -> None:
    commit, shared = commit_of(tmp_path), board()
    os.makedirs(commit.tmp_dir)
    (Path(commit.tmp_dir) / "rank_00000.json").write_text("{}")
    threading.Timer(0.2, shared.post, [Failure(1, "no space left writing rank_00001.bin")]).start()
    start = time.monotonic()
    with pytest.raises(RankFailed, match="no space left writing rank_00001.bin") as caught:
        commit.wait_for_records(600, board=shared)
    assert caught.value.failure.rank == 1
    assert time.monotonic() - start < 5
    # settle: a failure counts as finished; rank 2 still writes until it records
    threading.Timer(0.2, (Path(commit.tmp_dir) / "rank_00002.json").write_text, ["{}"]).start()
    commit.wait_for_records(600, others_only=True, board=shared, settle=True)
    assert (Path(commit.tmp_dir) / "rank_00002.json").exists()


def test_an_async_commit_giving_a_silent_rank_up_removes_the_save_without_waiting_again(
        tmp_path: Path) -> None:
    commit = commit_of(tmp_path, world=2)  # rank 1 never writes anything
    plan = writer.plan_rank([DictSource(tensors()).export_state({})])
    saver = AsyncSaver(timeout_s=2.0)
    start = time.monotonic()
    saver.start(RankWrite(commit.tmp_dir, 0, plan, {}, tag="t"), commit, "t", board(2))
    error = saver.wait()
    took = time.monotonic() - start
    assert error is not None and "rank(s) 1 wrote nothing for 2 s" in error, error
    assert 2.0 <= took < 3.5, took  # one timeout, not a second one waiting for rank 1 again
    assert not os.path.exists(commit.tmp_dir)


def test_without_a_store_a_failure_goes_into_an_error_file(tmp_path: Path) -> None:
    commit = commit_of(tmp_path, world=2)

    class Broken:
        def set(self, *_: Any) -> None:
            raise RuntimeError("store gone")

    write = RankWrite(commit.tmp_dir, 1, RankPlan(), {},
                      board=SaveBoard(Broken(), "p/", 2))
    os.makedirs(commit.tmp_dir)
    write.fail(Failure(1, "no space left writing rank_00001.bin"))
    with pytest.raises(RankFailed, match="no space left writing rank_00001.bin"):
        commit.wait_for_records(600, others_only=True)


def test_a_writer_stops_when_another_rank_failed(tmp_path: Path) -> None:
    shared = board(2)
    shared.post(Failure(0, "committing: disk full"))
    plan = writer.plan_rank([DictSource(tensors()).export_state({})])
    write = RankWrite(str(tmp_path / "t.tmp"), 1, plan, {}, board=shared)
    old = writer.BOARD_CHECK_S
    writer.BOARD_CHECK_S = 0.0
    try:
        with pytest.raises(RankFailed, match="committing: disk full"):
            write.run()
    finally:
        writer.BOARD_CHECK_S = old
    write.fail(Failure(0, "committing: disk full"))
    assert shared.posted()[1] == Failure(1, "committing: disk full", cause=False)


def test_previous_failures_are_raised_cause_first() -> None:
    raise_first([None, None], "the previous asynchronous save")
    with pytest.raises(CheckpointError) as caught:
        raise_first([None, "no space ... rank_00001.bin", "no space ... rank_00001.bin"], "x")
    assert str(caught.value) == "no space ... rank_00001.bin"
    with pytest.raises(CheckpointError) as caught:
        raise_first(["A", "B", "A"], "the save")
    assert str(caught.value) == "A\n  the save also failed on rank 1: B"


def test_stale_interrupted_saves_of_other_tags_are_removed(tmp_path: Path) -> None:
    old = time.time() - 1000
    for name, files in (("global_step9.tmp", ["rank_00000.bin", "rank_00001.json.tmp.77"]),
                        ("fresh.tmp", ["rank_00000.bin"]),
                        ("mine.tmp", ["rank_00000.bin", "notes.txt"]),
                        ("empty.tmp", []), ("t.tmp", ["rank_00000.bin"])):
        (tmp_path / name).mkdir()
        for f in files:
            (tmp_path / name / f).write_bytes(b"x")
            if name != "fresh.tmp":
                os.utime(tmp_path / name / f, (old, old))
        if name != "fresh.tmp":
            os.utime(tmp_path / name, (old, old))
    assert remove_stale_saves(str(tmp_path), "t", 600) == ["global_step9"]
    assert sorted(os.listdir(tmp_path)) == ["empty.tmp", "fresh.tmp", "mine.tmp", "t.tmp"]


def test_fragments_reject_wrong_lengths_and_unshardable_state() -> None:
    with pytest.raises(ValueError, match="want \\(3,\\)"):
        Fragment("x", 0, 3, torch.zeros(4))
    with pytest.raises(ValueError, match="not one value per element"):
        split_state({"row": torch.zeros(2), "step": 1}, 6, "x")
    views, rest = split_state({"m": torch.ones(2, 3), "step": torch.tensor(1.0)}, 6, "x")
    assert views["m"].shape == (6,) and rest["step"].item() == 1.0


def test_install_state_keeps_unnamed_tensors_and_container_types() -> None:
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([a, b], lr=0.1, betas=(0.8, 0.9))
    a.grad, b.grad = torch.ones(3), torch.ones(2)
    opt.step()
    kept = opt.state[b]["exp_avg"].clone()
    install_state(opt, {id(a): {"step": torch.tensor(7.0), "exp_avg": torch.full((3,), 2.0),
                                "exp_avg_sq": torch.ones(3)}},
                  [{"lr": 0.25, "betas": [0.5, 0.6], "foreach": True}])
    assert opt.state[a]["step"].item() == 7.0 and torch.equal(opt.state[b]["exp_avg"], kept)
    group = opt.param_groups[0]
    assert group["lr"] == 0.25 and group["betas"] == (0.5, 0.6) and group["foreach"] is None


def test_agreement_helpers_name_the_ranks() -> None:
    check_same(["a", "a"], "the tag")
    with pytest.raises(CheckpointError, match=r"ranks 0, 2: 'a'; rank 1: 'b'"):
        check_same(["a", "b", "a"], "the tag")
    raise_failures([None, None], "x")
    with pytest.raises(CheckpointError, match="x failed on ranks 0, 1: disk"):
        raise_failures(["disk", "disk"], "x")
    with pytest.raises(CheckpointError, match="rank 0: a\n  rank 1: b"):
        raise_failures(["a", "b"], "x")


# ------------------------------------------------------ state dict files


def test_streamed_torch_save_file_loads_like_torch_save(tmp_path: Path) -> None:
    values = {"w": torch.randn(3, 4), "i": torch.arange(5), "h": torch.randn(2).half(),
              "s": torch.tensor(2.5), "e": torch.zeros(0, 3)}
    specs = [Spec(n, tuple(v.shape), v.dtype) for n, v in values.items()]
    order = ["w", "tied", "i", "h", "s", "e"]
    writer = TorchSaveWriter(str(tmp_path / "m.pt"), specs, {"tied": "w"}, order)
    for name in ["e", "s", "h", "i", "w"]:  # any order
        writer.write(values[name], name)
    writer.close()
    for kwargs in ({}, {"mmap": True}):
        loaded = torch.load(tmp_path / "m.pt", **kwargs)  # weights_only by default
        assert list(loaded) == order
        assert all(torch.equal(loaded[n], values[n]) and loaded[n].dtype == values[n].dtype
                   for n in values)
        assert loaded["tied"].data_ptr() == loaded["w"].data_ptr()
    assert [p.name for p in tmp_path.iterdir()] == ["m.pt"]  # no temporary file left


def test_streamed_safetensors_file(tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    values = {"w": torch.randn(3, 4), "i": torch.arange(5), "b": torch.randn(2).bfloat16()}
    specs = [Spec(n, tuple(v.shape), v.dtype) for n, v in values.items()]
    writer = SafetensorsWriter(str(tmp_path / "m.st"), specs, {"tied": "w"},
                               ["w", "i", "tied", "b"])
    for name in ("w", "i", "b"):
        writer.write(values[name], name)
    writer.close()
    loaded = safetensors.load_file(str(tmp_path / "m.st"))
    assert set(loaded) == {"w", "i", "tied", "b"}
    assert all(torch.equal(loaded[n], values[n]) for n in values)
    assert torch.equal(loaded["tied"], values["w"])


def test_to_fp32_and_get_fp32_state_dict(tmp_path: Path) -> None:
    save(tmp_path, DictSource(tensors(), parts=2), aliases={"tied": "b"})
    done = to_fp32(str(tmp_path), str(tmp_path / "out.pt"))
    loaded, in_memory = torch.load(tmp_path / "out.pt"), get_fp32_state_dict(str(tmp_path))
    assert list(loaded) == list(in_memory) == ["a.weight", "b", "half", "tied"]
    for name, t in tensors().items():
        assert loaded[name].dtype == torch.float32 and torch.equal(loaded[name], t.float())
    assert done.largest == "a.weight" and done.tensors == 3
    with pytest.raises(CheckpointError, match="does not exist"):
        to_fp32(str(tmp_path / "none"), str(tmp_path / "x.pt"))


@pytest.mark.parametrize("out,why", [
    ("nodir/out.pt", "the directory nodir does not exist"),
    ("afile/out.pt", "afile is not a directory"),
    ("afile/sub/", "afile is not a directory"),
])
@pytest.mark.parametrize("safetensors", [False, True])
def test_to_fp32_refuses_an_output_it_cannot_write_before_any_work(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        out: str, why: str, safetensors: bool) -> None:
    from dsrun.launcher import cli
    from dsrun.runtime.checkpoint import consolidate

    save(tmp_path / "ckpt", DictSource(tensors()))
    (tmp_path / "afile").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(consolidate, "iter_tensors", None)  # no tensor is to be read
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(CheckpointError, match=why):
        to_fp32("ckpt", out, safetensors=safetensors)
    flags = ["--safetensors"] if safetensors else []
    assert cli.main(["checkpoint", "to-fp32", "ckpt", out, *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dsrun: error: ") and err.count("\n") == 1 and out in err, err
    assert why in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing left behind


def test_to_fp32_failing_to_write_removes_its_file(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    save(tmp_path / "ckpt", DictSource(tensors()))
    (tmp_path / "old.pt").write_text("old")
    (tmp_path / "old.pt.tmp").write_text("the user's")

    def full(*args: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(TorchSaveWriter, "write", full)
    with pytest.raises(CheckpointError, match="out.pt failed: No space left on device"):
        to_fp32(str(tmp_path / "ckpt"), str(tmp_path / "out.pt"))
    with pytest.raises(CheckpointError, match="old.pt failed: No space left on device"):
        to_fp32(str(tmp_path / "ckpt"), str(tmp_path / "old.pt"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "old.pt", "old.pt.tmp"]
    assert (tmp_path / "old.pt").read_text() == "old"
    assert (tmp_path / "old.pt.tmp").read_text() == "the user's"


@pytest.mark.parametrize("safetensors", [False, True])
def test_to_fp32_writes_through_a_symlink_and_leaves_other_files_alone(
        tmp_path: Path, safetensors: bool) -> None:
    save(tmp_path / "ckpt", DictSource(tensors()))
    (tmp_path / "tgt").mkdir()
    (tmp_path / "tgt" / "model.bin").write_text("old")
    (tmp_path / "tgt" / "model.bin").chmod(0o640)
    (tmp_path / "link.bin").symlink_to(tmp_path / "tgt" / "model.bin")
    (tmp_path / "link.bin.tmp").write_text("the user's")
    (tmp_path / "tgt" / "model.bin.tmp").write_text("the user's too")
    done = to_fp32(str(tmp_path / "ckpt"), str(tmp_path / "link.bin"), safetensors=safetensors)
    assert done.path == str(tmp_path / "link.bin")
    assert (tmp_path / "link.bin").is_symlink()
    target = tmp_path / "tgt" / "model.bin"
    assert target.stat().st_mode & 0o777 == 0o640  # the old file's mode
    if safetensors:
        loaded = pytest.importorskip("safetensors.torch").load_file(str(target))
    else:
        loaded = torch.load(target)
    assert torch.equal(loaded["a.weight"], tensors()["a.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "link.bin", "link.bin.tmp",
                                                          "tgt"]
    assert sorted(p.name for p in (tmp_path / "tgt").iterdir()) == ["model.bin",
                                                                    "model.bin.tmp"]
    assert (tmp_path / "link.bin.tmp").read_text() == "the user's"


def test_shards_and_their_index_are_written_through_symlinks(tmp_path: Path) -> None:
    import json

    from dsrun.runtime.checkpoint.consolidate import write_shards

    save(tmp_path / "ckpt", DictSource(tensors()))
    (tmp_path / "out").mkdir()
    (tmp_path / "kept").mkdir()
    index = tmp_path / "kept" / "index.json"
    index.write_text("a previous run's")
    (tmp_path / "out" / "pytorch_model.bin.index.json").symlink_to(index)
    done = write_shards(str(tmp_path / "ckpt"), str(tmp_path / "out"), max_shard_size=1)
    assert len(done.files) > 1 and done.index is not None
    assert (tmp_path / "out" / "pytorch_model.bin.index.json").is_symlink()
    weight_map = json.loads(index.read_text())["weight_map"]
    assert set(weight_map) == set(tensors())
    assert set(weight_map.values()) == {os.path.basename(f) for f in done.files}


@pytest.mark.parametrize("make,why", [
    (lambda p: os.mkfifo(p), "it is a FIFO, not a regular file"),
    (lambda p: p.symlink_to(p.name), "Too many levels of symbolic links"),
    (lambda p: p.symlink_to("/dev/null"), "it is a character device, not a regular file"),
    (lambda p: (p.mkdir(), (p / "pytorch_model.bin").mkdir()),
     "it is a directory, not a regular file"),
], ids=["fifo", "symlink-loop", "device", "directory"])
def test_to_fp32_refuses_an_output_that_is_not_a_regular_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        make: Any, why: str) -> None:
    from dsrun.launcher import cli
    from dsrun.runtime.checkpoint import consolidate

    save(tmp_path / "ckpt", DictSource(tensors()))
    make(tmp_path / "out")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(consolidate, "iter_tensors", None)  # no tensor is to be read
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(CheckpointError, match=why):
        to_fp32("ckpt", "out")
    assert cli.main(["checkpoint", "to-fp32", "ckpt", "out"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("dsrun: error: cannot write out") and err.count("\n") == 1, err
    assert why in err
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing replaced or left


def test_info_describes_the_tags(tmp_path: Path) -> None:
    save(tmp_path, DictSource(tensors()), tag="first")
    save(tmp_path, DictSource(tensors()), tag="second")
    save(tmp_path, DictSource(tensors()), tag="step12", save_latest=False)
    save(tmp_path, DictSource(tensors()), tag="step3", save_latest=False)
    (tmp_path / "third.tmp").mkdir()
    info = checkpoint_info(str(tmp_path))
    text = "\n".join(format_info(info))
    assert "tags: first, second (latest), step3, step12" in text
    assert "interrupted saves (not loadable): third - a later save removes them once " \
           f"unchanged for checkpoint.timeout, or remove them: rm -r {tmp_path}/third.tmp" in text
    assert "tag second: saved" in text and "ZeRO stage 2" in text and "step 4" in text
    assert "parameters: 52 in 3 tensors (52 trained)" in text
    assert "optimizer: Fake" in text and "largest tensor a.weight [5, 7]" in text
    assert checkpoint_info(str(tmp_path), "first").selected.tag == "first"
    assert checkpoint_info(str(tmp_path / "first")).selected.tag == "first"
    with pytest.raises(CheckpointError, match="holds no dsrun checkpoint"):
        checkpoint_info(str(tmp_path / "third.tmp"))


@pytest.mark.parametrize("safetensors", [False, True])
def test_to_fp32_into_a_new_directory_named_with_a_trailing_slash(
        tmp_path: Path, safetensors: bool) -> None:
    from click.testing import CliRunner

    from dsrun.launcher.checkpoint_cli import checkpoint

    save(tmp_path / "ckpt", DictSource(tensors()))
    out = tmp_path / "new" / "dir"
    argv = ["to-fp32", str(tmp_path / "ckpt"), str(out) + os.sep]
    result = CliRunner().invoke(checkpoint, argv + (["--safetensors"] if safetensors else []))
    assert result.exit_code == 0, result.output
    name = "model.safetensors" if safetensors else "pytorch_model.bin"
    assert out.is_dir() and [p.name for p in out.iterdir()] == [name]
    if not safetensors:
        assert torch.equal(torch.load(out / name)["a.weight"], tensors()["a.weight"].float())


def test_to_fp32_cli_can_exclude_frozen_parameters(tmp_path: Path) -> None:
    """``--exclude_frozen_parameters``, as the Python API and zero_to_fp32 have it."""
    from click.testing import CliRunner

    from dsrun.launcher.checkpoint_cli import checkpoint

    class FrozenB(DictSource):
        def _infos(self) -> dict[str, TensorInfo]:  # "b" in no param group: frozen
            return {n: TensorInfo(n, tuple(t.shape), t.dtype, "param", None if n == "b" else 0)
                    for n, t in self.tensors.items()}

    save(tmp_path / "ckpt", FrozenB(tensors()))
    for flags, keys in (([], ["a.weight", "b", "half"]),
                        (["--exclude_frozen_parameters"], ["a.weight", "half"])):
        out = tmp_path / f"out{len(flags)}.bin"
        result = CliRunner().invoke(checkpoint, ["to-fp32", str(tmp_path / "ckpt"), str(out),
                                                 *flags])
        assert result.exit_code == 0, result.output
        assert sorted(torch.load(out)) == keys
