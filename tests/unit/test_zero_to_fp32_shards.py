"""Shard planning for ``zero_to_fp32`` output (pure): Hugging Face's cut,
file names, index and sizes."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsrun.runtime.checkpoint.shards import Shard, index_json, parse_size, plan_shards


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("1.5MB") == 1_500_000
    assert parse_size(" 2 kib ") == 2048
    assert parse_size("300B") == parse_size("300") == parse_size(300) == 300
    for bad in ("lots", "5XB", "", "-1GB", 0, True):
        with pytest.raises(ValueError, match="max_shard_size"):
            parse_size(bad)  # type: ignore[arg-type]


def test_one_file_when_everything_fits_or_no_limit() -> None:
    sizes = {"a": 10, "b": 20}
    for limit in (None, 30, 10**9):
        assert plan_shards(["a", "b"], sizes, {}, limit, False) == [
            Shard("pytorch_model.bin", ("a", "b"))]
    assert plan_shards(["a"], {"a": 99}, {}, 5, True) == [Shard("model.safetensors", ("a",))]


def test_huggingface_cut_oversized_tensors_and_tied_names() -> None:
    order = ["a", "big", "b", "tied", "c", "d"]
    sizes = {"a": 40, "big": 500, "b": 50, "c": 30, "d": 80}
    shards = plan_shards(order, sizes, {"tied": "a"}, 100, False)
    # "big" gets its own shard, ahead of the one being filled (huggingface_hub's order);
    # "tied" joins "a"'s shard and adds nothing; "c" would take [a, b] past 100
    assert shards == [Shard("pytorch_model-00001-of-00004.bin", ("big",)),
                      Shard("pytorch_model-00002-of-00004.bin", ("a", "b", "tied")),
                      Shard("pytorch_model-00003-of-00004.bin", ("c",)),
                      Shard("pytorch_model-00004-of-00004.bin", ("d",))]
    text = index_json(shards, 700)
    assert text.endswith("}\n") and json.loads(text) == {
        "metadata": {"total_size": 700},
        "weight_map": {k: s.file for s in shards for k in s.keys}}
    assert list(json.loads(text)["weight_map"]) == sorted(order)  # sort_keys, as the hub


@given(st.lists(st.integers(0, 60), min_size=1, max_size=20), st.integers(1, 100),
       st.data())
def test_every_key_once_and_shards_within_the_limit(sizes: list[int], limit: int,
                                                    data: st.DataObject) -> None:
    names = [f"t{i}" for i in range(len(sizes))]
    aliases = {f"alias{i}": data.draw(st.sampled_from(names))
               for i in range(data.draw(st.integers(0, 3)))}
    order = data.draw(st.permutations([*names, *aliases]))
    shards = plan_shards(order, dict(zip(names, sizes)), aliases, limit, True)
    keys = [k for s in shards for k in s.keys]
    assert sorted(keys) == sorted(order)
    home = {k: s for s in shards for k in s.keys}
    for alias, target in aliases.items():
        assert home[alias] is home[target]
    for shard in shards:
        stored = [k for k in shard.keys if k in names]
        assert stored  # no shard of tied names only
        assert sum(sizes[names.index(k)] for k in stored) <= limit or len(stored) == 1
    if len(shards) > 1:
        assert [s.file for s in shards] == [
            f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
