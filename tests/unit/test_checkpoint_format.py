"""The checkpoint format without processes: manifest, records, read plans,
tags and the replicated split (pure code, properties checked with hypothesis)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint.manifest import (
    VERSION,
    Chunk,
    Item,
    Manifest,
    TensorEntry,
    coverage_gaps,
    encode,
    parse_manifest,
    plan_reads,
)
from dsrun.runtime.checkpoint.records import ChunkRecord, RankRecord, merge_records
from dsrun.runtime.checkpoint.tags import (
    DEFAULT_NAME_MAX,
    check_tag,
    check_tag_fits,
    length_problem,
    list_tags,
    name_max,
    read_latest,
    tag_dir,
    tag_problem,
)


def entry(name: str = "w", numel: int = 10, chunks: tuple = ((0, 0, 0, 10),)) -> TensorEntry:
    item = Item("float32", tuple(Chunk(r, off, a, b, 0) for r, off, a, b in chunks))
    return TensorEntry(name, (numel,), "float32", "param", 0, {"value": item})


def manifest_text(e: TensorEntry, files: dict, **changes: object) -> str:
    data = Manifest("t", 1, {e.name: e}, files).to_json()
    data.update(changes)
    return json.dumps(data)


def test_manifest_round_trips() -> None:
    e = entry(chunks=((0, 0, 0, 4), (1, 8, 4, 10)))
    files = {"rank_00000.bin": {"bytes": 16}, "rank_00001.bin": {"bytes": 32}}
    parsed = parse_manifest(manifest_text(e, files), "m.json")
    assert parsed.tensors["w"] == e and parsed.files == files and parsed.version == VERSION


@pytest.mark.parametrize("chunks, message", [
    (((0, 0, 0, 4), (0, 16, 5, 10)), "a gap at element 4"),
    (((0, 0, 0, 6), (0, 24, 5, 10)), "an overlap at element 5"),
    (((0, 0, 0, 4),), "covers 4 of its 10 elements"),
    (((0, 30, 0, 10),), "points past the end of rank_00000.bin"),
])
def test_inconsistent_manifests_are_refused(chunks: tuple, message: str) -> None:
    text = manifest_text(entry(chunks=chunks), {"rank_00000.bin": {"bytes": 64}})
    with pytest.raises(CheckpointError, match=message):
        parse_manifest(text, "m.json")


@pytest.mark.parametrize("change, message", [
    ({"version": 7}, "format version 7; this dsrun reads version 1"),
    ({"format": "other"}, "not a dsrun checkpoint manifest"),
    ({"tensors": {"w": {"shape": [2]}}}, "malformed manifest"),
])
def test_bad_manifests_name_the_file(change: dict, message: str) -> None:
    text = manifest_text(entry(), {"rank_00000.bin": {"bytes": 40}}, **change)
    with pytest.raises(CheckpointError, match=f"m.json: .*{message}"):
        parse_manifest(text, "m.json")


@st.composite
def split_and_range(draw: st.DrawFn) -> tuple[int, list[int], int, int]:
    numel = draw(st.integers(1, 200))
    cuts = sorted(set(draw(st.lists(st.integers(1, numel - 1), max_size=8)))) if numel > 1 else []
    start = draw(st.integers(0, numel - 1))
    end = draw(st.integers(start + 1, numel))
    return numel, cuts, start, end


@given(split_and_range())
@settings(max_examples=200, deadline=None)
def test_read_plans_cover_the_wanted_range_exactly(case: tuple) -> None:
    numel, cuts, start, end = case
    bounds = [0, *cuts, numel]
    item = Item("float32", tuple(Chunk(i % 3, 4 * a, a, b, 0)
                                 for i, (a, b) in enumerate(zip(bounds, bounds[1:]))))
    reads = plan_reads(item, start, end)
    assert [r.lo for r in reads][0] == start and reads[-1].hi == end
    for before, after in zip(reads, reads[1:]):
        assert before.hi == after.lo
    for read in reads:
        assert read.chunk.start <= read.lo < read.hi <= read.chunk.end


def test_coverage_gaps() -> None:
    assert coverage_gaps([(0, 3), (5, 8)], 10) == [(3, 5), (8, 10)]
    assert coverage_gaps([(0, 10)], 10) == []


def record(rank: int, chunks: list, shape: tuple = (10,), **kw: object) -> RankRecord:
    tensors = {"w": {"shape": list(shape), "dtype": "float32", "kind": "param", "group": 0}}
    return RankRecord(rank, 64, tensors, tuple(ChunkRecord("w", *c) for c in chunks), **kw)


def test_merge_records_joins_the_ranks_chunks() -> None:
    records = [record(0, [("value", "float32", 0, 0, 6, 1)], scalars={"w": {"step": 3}},
                      groups=({"lr": 0.1},), optimizer="AdamW"),
               record(1, [("value", "float32", 0, 6, 10, 2)])]
    m = merge_records(records, "t", {}, {"zero_stage": 2}, {"tied": "w"})
    assert [c.rank for c in m.tensors["w"].items["value"].chunks] == [0, 1]
    assert m.tensors["w"].scalars == {"step": 3} and m.optimizer == "AdamW"
    assert m.aliases == {"tied": "w"} and m.world_size == 2


@pytest.mark.parametrize("records, message", [
    ([record(0, [("value", "float32", 0, 0, 6, 1)])], r"no rank wrote elements \[6, 10\)"),
    ([record(0, [("value", "float32", 0, 0, 10, 1)]), record(1, [], shape=(11,))],
     "ranks disagree on tensor 'w'"),
    ([record(0, [("value", "float32", 0, 0, 5, 1)]),
      record(1, [("value", "float16", 0, 5, 10, 1)])], "written as float32 and as float16"),
])
def test_merge_records_refuses_inconsistent_saves(records: list, message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        merge_records(records, "t", {}, {}, {})


def test_encode_scalars_and_hyperparameters() -> None:
    import torch

    assert encode((0.9, 0.999)) == [0.9, 0.999]
    assert encode(torch.tensor(3.0)) == {"tensor": "float32", "value": 3.0}
    assert encode(float("inf")) == {"float": "inf"}
    assert encode(object())["unsupported"].startswith("<object")


@pytest.mark.parametrize("tag, ok", [("global_step10", True), ("a b", True), ("a/b", False),
                                     ("latest", False), ("x.tmp", False), ("x.replaced", False),
                                     ("", False), ("..", False), ("a\nb", False), (3, False)])
def test_tag_names(tag: object, ok: bool) -> None:
    assert (tag_problem(tag) is None) == ok


@pytest.mark.parametrize("tag, ok", [("x" * 246, True), ("x" * 247, False),
                                     ("\u00e9" * 123, True), ("\u00e9" * 124, False)])
def test_a_tag_and_the_longest_suffix_fit_in_one_name(tag: str, ok: bool) -> None:
    """255 bytes less '.replaced': bytes as the file system gets them (é is 2)."""
    problem = length_problem(tag, 255, "/ck")
    assert (problem is None) == ok
    if not ok:
        assert problem is not None and f"the tag {tag!r} is {len(tag.encode())} bytes long" \
            in problem and "more than the 246 a checkpoint tag may have in /ck" in problem
        assert "names of 255 bytes" in problem and "TAG.replaced" in problem


@pytest.mark.parametrize("tag, at", [("\udcff", 0), ("step\ud800x", 4)])
def test_a_tag_that_is_not_valid_text_is_refused_naming_it(tag: str, at: int) -> None:
    """A lone surrogate (os.fsdecode of bytes that are not UTF-8: '\\udcff')
    cannot go into `latest` as UTF-8 (nor, some, into a file name): the same
    one error as other bad tags, naming the tag, not a bare UnicodeEncodeError."""
    problem = tag_problem(tag)
    assert problem is not None
    assert problem.startswith(f"the tag {tag!r} cannot be a directory name: "
                              f"{tag[at]!r} at index {at} is not a character"), problem
    with pytest.raises(CheckpointError, match="cannot be a directory name"):
        check_tag(tag)


def test_a_name_max_larger_than_255_is_not_believed(monkeypatch: pytest.MonkeyPatch) -> None:
    """vfat/exFAT report 1530 (255 UTF-16 units x 6 bytes) but hold 255 units."""
    monkeypatch.setattr(os, "pathconf", lambda path, name: 1530)
    assert name_max("/") == 255
    with pytest.raises(CheckpointError, match="more than the 246 a checkpoint tag may have"):
        check_tag_fits("x" * 247, "/")


def test_name_max_is_asked_of_the_nearest_existing_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[str] = []

    def pathconf(path: str, name: str) -> int:
        asked.append(path)
        assert name == "PC_NAME_MAX"
        return 100

    monkeypatch.setattr(os, "pathconf", pathconf)
    assert name_max(str(tmp_path / "new" / "deeper")) == 100
    assert asked == [str(tmp_path)]
    with pytest.raises(CheckpointError, match="more than the 91 a checkpoint tag may have"):
        check_tag_fits("x" * 92, str(tmp_path / "new"))
    check_tag_fits("x" * 91, str(tmp_path / "new"))

    def unknown(path: str, name: str) -> int:
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "pathconf", unknown)
    assert name_max(str(tmp_path)) == DEFAULT_NAME_MAX == 255


def test_latest_and_tag_directories(tmp_path: Path) -> None:
    assert read_latest(str(tmp_path)) is None
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "manifest.json").write_text("{}")
    (tmp_path / "b.tmp").mkdir()
    (tmp_path / "latest").write_text("a\n")
    assert read_latest(str(tmp_path)) == "a"
    assert list_tags(str(tmp_path)) == (["a"], ["b"])
    assert tag_dir(str(tmp_path), "a") == str(tmp_path / "a")
    with pytest.raises(CheckpointError, match="'b'.*save never finished.*complete tags there: a"):
        tag_dir(str(tmp_path), "b")
    (tmp_path / "latest").write_text("../x")
    with pytest.raises(CheckpointError, match="does not hold a valid tag"):
        read_latest(str(tmp_path))


def test_a_tag_replaced_by_a_crashed_save_is_still_found(tmp_path: Path) -> None:
    (tmp_path / "a.replaced").mkdir()
    (tmp_path / "a.replaced" / "manifest.json").write_text("{}")
    assert tag_dir(str(tmp_path), "a") == str(tmp_path / "a.replaced")
