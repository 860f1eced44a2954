"""ZeRO partitioning maths (dsrun.runtime.zero.partition): properties and cases."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsrun.runtime.zero.partition import (
    GroupLayout,
    Piece,
    partition_group,
    partition_groups,
    plan_buckets,
    windows,
)

numels_st = st.lists(st.integers(0, 60), max_size=12)
world_st = st.integers(1, 9)
align_st = st.integers(1, 4)


@st.composite
def groups(draw):
    numels = draw(numels_st)
    trainable = draw(st.lists(st.booleans(), min_size=len(numels), max_size=len(numels)))
    return numels, trainable, draw(world_st), draw(align_st)


def _flat_owner_map(layout: GroupLayout) -> dict[int, tuple[int, int, int]]:
    """flat index -> (rank, param, param element), from the ranks' pieces."""
    seen: dict[int, tuple[int, int, int]] = {}
    for rank in range(layout.world_size):
        for piece in layout.pieces(rank):
            for k in range(piece.length):
                flat = piece.flat_offset + k
                assert flat not in seen, f"flat element {flat} owned twice"
                seen[flat] = (rank, piece.param, piece.param_offset + k)
    return seen


@settings(max_examples=300, deadline=None)
@given(groups())
def test_pieces_cover_every_trainable_element_exactly_once(case):
    numels, trainable, world, align = case
    layout = partition_group(numels, world, align, trainable)
    seen = _flat_owner_map(layout)
    covered = sorted((param, element) for _, param, element in seen.values())
    expected = [(i, e) for i, (n, t) in enumerate(zip(numels, trainable)) if t
                for e in range(n)]
    assert covered == expected


@settings(max_examples=300, deadline=None)
@given(groups())
def test_partitions_balanced_contiguous_padding_only_at_end(case):
    numels, trainable, world, align = case
    layout = partition_group(numels, world, align, trainable)
    assert layout.numel == sum(n for n, t in zip(numels, trainable) if t)
    assert layout.padded_numel % (world * align) == 0
    assert 0 <= layout.padding < world * align
    assert layout.partition_numel * world == layout.padded_numel
    assert layout.partition_numel % align == 0
    ranges = [layout.rank_range(r) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layout.padded_numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(end - start == layout.partition_numel for start, end in ranges)
    # Owned flat elements are exactly [0, numel): padding is the tail, unowned.
    assert sorted(_flat_owner_map(layout)) == list(range(layout.numel))
    for rank, (start, end) in enumerate(ranges):
        for piece in layout.pieces(rank):
            assert start <= piece.flat_offset and piece.flat_offset + piece.length <= end


@settings(max_examples=300, deadline=None)
@given(groups())
def test_pieces_map_back_to_the_right_parameter_elements(case):
    """Build the flat buffer from labelled parameters; every piece reads back
    the labels of its own parameter, and padding reads zero."""
    numels, trainable, world, align = case
    layout = partition_group(numels, world, align, trainable)
    params = [[(i + 1) * 1000 + e for e in range(n)] for i, n in enumerate(numels)]
    flat = [v for i, p in enumerate(params) if layout.offsets[i] is not None for v in p]
    flat += [0] * layout.padding
    assert len(flat) == layout.padded_numel
    for rank in range(world):
        start, end = layout.rank_range(rank)
        shard = flat[start:end]
        for piece in layout.pieces(rank):
            local = piece.shifted(start)
            got = shard[local.flat_offset:local.flat_offset + piece.length]
            want = params[piece.param][piece.param_offset:piece.param_offset + piece.length]
            assert got == want
        owned = sum(p.length for p in layout.pieces(rank))
        assert all(v == 0 for v in flat[max(start, layout.numel):end])
        assert owned == max(0, min(end, layout.numel) - start)


@settings(max_examples=200, deadline=None)
@given(groups(), st.data())
def test_pieces_in_any_range_and_param_owners_agree(case, data):
    numels, trainable, world, align = case
    layout = partition_group(numels, world, align, trainable)
    start = data.draw(st.integers(0, layout.padded_numel))
    end = data.draw(st.integers(start, layout.padded_numel))
    pieces = layout.pieces_in_range(start, end)
    assert sum(p.length for p in pieces) == max(0, min(end, layout.numel) - start)
    assert all(p.length > 0 for p in pieces)
    assert [p.flat_offset for p in pieces] == sorted(p.flat_offset for p in pieces)
    for i, numel in enumerate(numels):
        owners = layout.param_owners(i)
        if layout.offsets[i] is None:
            assert owners == ()
            continue
        assert sum(length for _, _, length in owners) == numel
        by_rank = {r: [p for p in layout.pieces(r) if p.param == i] for r in range(world)}
        for rank, offset, length in owners:
            assert by_rank[rank] == [Piece(i, offset, layout.offsets[i] + offset, length)]


def test_uneven_example_by_hand():
    # 3 + 5 + 2 = 10 elements on 3 ranks: padded to 12, partitions of 4.
    layout = partition_group([3, 5, 2], 3)
    assert (layout.numel, layout.padded_numel, layout.partition_numel) == (10, 12, 4)
    assert layout.pieces(0) == (Piece(0, 0, 0, 3), Piece(1, 0, 3, 1))
    assert layout.pieces(1) == (Piece(1, 1, 4, 4),)
    assert layout.pieces(2) == (Piece(2, 0, 8, 2),)
    assert layout.param_owners(1) == ((0, 0, 1), (1, 1, 4))


def test_frozen_parameters_are_excluded_and_keep_their_index():
    layout = partition_group([4, 6, 2], 2, trainable=[True, False, True])
    assert layout.offsets == (0, None, 4)
    assert layout.members == (0, 2)
    assert layout.pieces(0) == (Piece(0, 0, 0, 3),)
    assert layout.pieces(1) == (Piece(0, 3, 3, 1), Piece(2, 0, 4, 2))


def test_alignment_pads_to_world_times_alignment():
    layout = partition_group([5], 2, alignment=4)
    assert (layout.padded_numel, layout.partition_numel, layout.padding) == (8, 4, 3)


def test_empty_and_all_frozen_groups():
    for layout in (partition_group([], 4), partition_group([3, 0], 4, trainable=[False, True])):
        assert (layout.numel, layout.padded_numel, layout.partition_numel) == (0, 0, 0)
        assert all(layout.pieces(r) == () for r in range(4))
        assert layout.rank_range(3) == (0, 0)


def test_several_groups_are_independent():
    a, b = partition_groups([[3, 3], [7]], 2, trainable=[[True, True], [True]])
    assert (a.padded_numel, b.padded_numel) == (6, 8)
    assert b.pieces(1) == (Piece(0, 4, 4, 3),)


@pytest.mark.parametrize("bad", [
    dict(numels=[1], world_size=0), dict(numels=[-1], world_size=1),
    dict(numels=[1], world_size=2, alignment=0), dict(numels=[1.5], world_size=1),
    dict(numels=[1, 2], world_size=1, trainable=[True]),
])
def test_invalid_layouts_are_rejected(bad):
    with pytest.raises(ValueError):
        partition_group(**bad)


def test_rank_and_range_checks():
    layout = partition_group([4], 2)
    with pytest.raises(ValueError, match="rank 2"):
        layout.rank_range(2)
    with pytest.raises(ValueError, match="range"):
        layout.pieces_in_range(3, 9)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), max_size=20), st.integers(1, 60))
def test_plan_buckets_properties(sizes, cap):
    buckets = plan_buckets(sizes, cap)
    assert [i for bucket in buckets for i in bucket] == list(range(len(sizes)))
    for bucket in buckets:
        total = sum(sizes[i] for i in bucket)
        assert total <= cap or len(bucket) == 1
    # Greedy: the next bucket's first item would not have fitted.
    for first, second in zip(buckets, buckets[1:]):
        assert sum(sizes[i] for i in first) + sizes[second[0]] > cap


def test_windows():
    assert windows(10, 4) == ((0, 4), (4, 8), (8, 10))
    assert windows(0, 4) == ()
    assert windows(4, 4) == ((0, 4),)
