"""ZeRO stage 3 bookkeeping without processes: shards, persistence, master
layout, traces, prefetch planning, live-parameter accounting, the
divergence report and the rank-major gradient layout."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsrun.errors import DsrunConfigError
from dsrun.runtime.zero.divergence import (
    Event,
    GuardSettings,
    describe_divergence,
    fingerprint,
    first_divergence,
)
from dsrun.runtime.zero.reduce3 import write_rank_major
from dsrun.runtime.zero.stage3_plan import (
    LiveSet,
    MasterLayout,
    ShardSpec,
    TraceCursor,
    is_persistent,
    plan_prefetch,
    plan_reuse_keep,
)

# ------------------------------------------------------------------ shards


@given(st.integers(0, 200), st.integers(1, 9), st.integers(1, 4))
def test_shards_cover_the_parameter_once(numel: int, world: int, alignment: int) -> None:
    spec = ShardSpec(numel, world, alignment)
    assert spec.padded_numel == spec.shard_numel * world
    assert spec.shard_numel % alignment == 0
    assert spec.padded_numel - numel < world * alignment
    valid = [spec.valid(r) for r in range(world)]
    assert sum(valid) == numel
    # real elements first, padding only after the last real one
    assert valid == sorted(valid, reverse=True)
    assert spec.full_rows * spec.shard_numel + spec.remainder == numel
    assert spec.remainder < max(spec.shard_numel, 1)


def test_shard_examples() -> None:
    spec = ShardSpec(5, 4)
    assert (spec.shard_numel, spec.padded_numel, spec.full_rows, spec.remainder) == (2, 8, 2, 1)
    assert [spec.valid(r) for r in range(4)] == [2, 2, 1, 0]
    assert ShardSpec(0, 3).shard_numel == 0
    with pytest.raises(ValueError, match="outside world size"):
        spec.valid(4)


def test_persistence_threshold() -> None:
    assert is_persistent(100, 100, 2)  # numel <= threshold stays whole
    assert not is_persistent(101, 100, 2)
    assert is_persistent(10**9, 0, 1)  # world size 1: nothing to partition
    assert not is_persistent(10**9, 0, 1, host_resident=True)  # offload_param: on demand
    assert is_persistent(10, 10, 1, host_resident=True)
    assert is_persistent(0, 0, 4)  # empty parameters trivially
    with pytest.raises(ValueError, match="threshold"):
        is_persistent(5, -1, 2)


def test_master_layout_skips_frozen() -> None:
    layout = MasterLayout((4, 3, 5, 2), (True, False, True, True))
    assert layout.offsets == (0, None, 4, 9) and layout.numel == 11
    with pytest.raises(ValueError, match="trainable flags"):
        MasterLayout((1, 2), (True,))


# ------------------------------------------------------------------ traces


def test_trace_cursor_follows_the_previous_pass() -> None:
    cursor = TraceCursor(max_len=10)
    cursor.start_pass()
    assert not any(cursor.visit(m) for m in (0, 1, 2))  # first pass: nothing recorded yet
    cursor.start_pass()
    assert cursor.trace == (0, 1, 2)
    assert cursor.visit(0) and cursor.visit(1)
    assert not cursor.visit(5)  # left the trace
    assert not cursor.visit(2)  # and stays off it for the rest of the pass
    cursor.start_pass()
    assert cursor.trace == (0, 1, 5, 2)  # the new order is followed next


def test_trace_cursor_overflow_disables_prefetch() -> None:
    cursor = TraceCursor(max_len=3)
    cursor.start_pass()
    for m in range(5):
        cursor.visit(m)
    cursor.start_pass()
    assert cursor.trace == () and not cursor.visit(0)


# ---------------------------------------------------------------- prefetch

MODULES = {0: (10, 11), 1: (12,), 2: (13, 14), 3: (), 4: (15,)}
NUMELS = {10: 50, 11: 5, 12: 100, 13: 30, 14: 30, 15: 80}
TRACE = (0, 1, 2, 3, 4)


def _plan(position: int, resident: set[int] = frozenset(), ahead: int = 0, live: int = 0,
          bucket: int = 1000, max_live: int = 1000) -> tuple:
    return plan_prefetch(TRACE, position, MODULES, NUMELS, resident, ahead=ahead, live=live,
                         bucket=bucket, max_live=max_live)


def test_prefetch_walks_the_trace_under_the_bucket() -> None:
    assert _plan(0, bucket=200) == ((1, (12,)), (2, (13, 14)))  # 100 + 60 <= 200; + 80 > 200
    assert _plan(0, bucket=99) == ()  # stops at the first module that does not fit
    assert _plan(0, bucket=0) == ()  # 0 disables prefetching
    assert _plan(4) == ()  # end of the trace
    assert _plan(0, resident={12}) == ((2, (13, 14)), (4, (15,)))  # resident: passed over
    assert _plan(0, ahead=150, bucket=200) == ()  # already fetched ahead counts


def test_prefetch_respects_max_live() -> None:
    assert _plan(0, live=55, max_live=200) == ((1, (12,)),)  # 55 + 100 + 60 > 200
    assert _plan(0, live=150, max_live=200) == ()


def test_prefetch_names_a_shared_parameter_once() -> None:
    modules = {0: (1,), 1: (2, 3), 2: (3, 4)}
    plan = plan_prefetch((0, 1, 2), 0, modules, {1: 1, 2: 1, 3: 1, 4: 1}, set(), ahead=0,
                         live=0, bucket=10, max_live=10)
    assert plan == ((1, (2, 3)), (2, (4,)))


@st.composite
def schedules(draw):
    n_modules = draw(st.integers(1, 8))
    modules = {m: tuple(draw(st.lists(st.integers(0, 11), max_size=3, unique=True)))
               for m in range(n_modules)}
    numels = {p: draw(st.integers(1, 40)) for p in range(12)}
    trace = tuple(draw(st.lists(st.integers(0, n_modules - 1), min_size=1, max_size=12)))
    return modules, numels, trace, draw(st.integers(0, 120)), draw(st.integers(0, 150))


@settings(max_examples=300, deadline=None)
@given(schedules())
def test_simulated_pass_keeps_the_bounds(schedule) -> None:
    """A forward pass over the trace with demand gathers, prefetch and
    release at module exit: every module finds its parameters resident;
    prefetching never passes the bucket nor max_live; the live count is
    what is really gathered."""
    modules, numels, trace, bucket, max_live = schedule
    live = LiveSet()
    for position, module in enumerate(trace):
        for p in modules[module]:  # demand gather
            if p not in live:
                live.add(p, numels[p], ahead=False)
            live.use(p)
        before = live.live
        plan = plan_prefetch(trace, position, modules, numels, live.ids(), ahead=live.ahead,
                             live=live.live, bucket=bucket, max_live=max_live)
        planned = [p for _, params in plan for p in params]
        assert len(planned) == len(set(planned))
        for p in planned:
            assert p not in live
            live.add(p, numels[p], ahead=True)
        if plan:
            assert live.ahead <= bucket and live.live <= max_live
        assert live.live <= max(max_live, before)
        assert all(p in live for p in modules[module])
        for p in modules[module]:  # release at module exit
            live.remove(p)
        assert live.live == sum(numels[p] for p in live.ids())
        assert live.ahead <= live.live


# ------------------------------------------------------------ reuse distance

CHAIN = {0: (10,), 1: (11,), 2: (12,)}
CHAIN_NUMELS = {10: 5, 11: 7, 12: 9}


def _keep(max_distance: int, max_live: int = 1000, modules=CHAIN,
          forward=(0, 1, 2), backward=(2, 1, 0)) -> frozenset:
    return plan_reuse_keep(forward, backward, modules, CHAIN_NUMELS,
                           max_distance=max_distance, max_live=max_live)


def test_reuse_distance_counts_the_uses_in_between() -> None:
    """Distances: 12 is used again at once (0); 11 after module 2's
    forward and backward (9 + 9); 10 after 7 + 9 + 9 + 7 elements."""
    assert _keep(0) == frozenset()  # 0 turns it off
    assert _keep(1) == {12}
    assert _keep(18) == {12} and _keep(19) == {12, 11}
    assert _keep(32) == {12, 11} and _keep(33) == {12, 11, 10}
    assert _keep(10**9, max_live=16) == {12, 11}  # nearest first within max_live
    assert _keep(10**9, max_live=15) == {12}
    assert _keep(10**9, backward=(2, 1)) == {12, 11}  # 10 is not used in backward
    assert _keep(10**9, backward=()) == frozenset()
    with pytest.raises(ValueError, match="max_distance"):
        _keep(-1)


def test_reuse_distance_starts_at_the_last_forward_use() -> None:
    """A tied weight (modules 0 and 2) is measured from its use in module
    2, the last one in forward."""
    tied = {0: (10,), 1: (11,), 2: (10, 12)}
    assert _keep(1, modules=tied) == {10, 12}
    assert _keep(28, modules=tied) == {10, 12}  # 11: module 2 (14) in forward and backward
    assert _keep(29, modules=tied) == {10, 11, 12}


def _distance(forward, backward, modules, numels, p):
    """Brute force: elements used strictly between p's last forward use and
    its first backward use (each module's parameters once per use)."""
    sequence = list(forward) + list(backward)
    last = max(i for i, m in enumerate(forward) if p in modules[m])
    first = min(len(forward) + i for i, m in enumerate(backward) if p in modules[m])
    return sum(numels[q] for m in sequence[last + 1:first] for q in set(modules[m]))


@settings(max_examples=300, deadline=None)
@given(schedules(), st.lists(st.integers(0, 7), max_size=12), st.integers(0, 200))
def test_reuse_keep_matches_the_definition(schedule, backward, distance) -> None:
    modules, numels, forward, _, max_live = schedule
    backward = tuple(m for m in backward if m in modules)
    kept = plan_reuse_keep(forward, backward, modules, numels, max_distance=distance,
                           max_live=max_live)
    unlimited = plan_reuse_keep(forward, backward, modules, numels, max_distance=distance,
                                max_live=10**9)
    used_forward = {p for m in forward for p in modules[m]}
    used_backward = {p for m in backward for p in modules[m]}
    expected = {p for p in used_forward & used_backward
                if _distance(forward, backward, modules, numels, p) < distance}
    assert unlimited == expected
    assert kept <= unlimited and sum(numels[p] for p in kept) <= max_live
    far = [_distance(forward, backward, modules, numels, p) for p in unlimited - kept]
    near = [_distance(forward, backward, modules, numels, p) for p in kept]
    assert not far or not near or max(near) <= min(far)  # nearest first


def test_live_set_accounting() -> None:
    live = LiveSet()
    live.add(1, 10, ahead=True)
    live.add(2, 5, ahead=False)
    assert (live.live, live.ahead, live.peak) == (15, 10, 15)
    live.use(1)
    assert live.ahead == 0
    live.remove(1)
    live.remove(7)  # unknown: ignored
    assert (live.live, live.peak) == (5, 15)
    with pytest.raises(ValueError, match="already live"):
        live.add(2, 5, ahead=False)


# -------------------------------------------------------------- divergence


def _events(names: list[str], start: int = 0) -> list[Event]:
    return [Event(start + i, 0, "forward", n, fingerprint("forward", n)) for i, n in
            enumerate(names)]


def test_fingerprint_is_stable_and_distinguishes() -> None:
    assert fingerprint("forward", "a", [1, 2], [3, 4]) == fingerprint("forward", "a", [1, 2],
                                                                      [3, 4])
    assert fingerprint("forward", "a", [1]) != fingerprint("backward", "a", [1])
    assert fingerprint("forward", "a", [1]) != fingerprint("forward", "a", [2])
    assert 0 <= fingerprint("x", "y") < 2 ** 56


def test_first_divergence() -> None:
    same = {0: _events(["t", "a"]), 1: _events(["t", "a"])}
    assert first_divergence(same) is None
    swapped = {0: _events(["t", "a", "h"]), 1: _events(["t", "b", "h"])}
    assert first_divergence(swapped) == 1
    stopped = {0: _events(["t", "a", "h"]), 1: _events(["t", "a"])}
    assert first_divergence(stopped) == 2
    # histories are ring buffers: compare only where all of them are known
    shifted = {0: _events(["x", "y", "z"], start=5), 1: _events(["y", "q"], start=6)}
    assert first_divergence(shifted) == 7


def test_describe_divergence_names_modules_and_ranks() -> None:
    text = describe_divergence({0: _events(["t", "a"]), 1: _events(["t", "b"]), 2: None},
                               cause="test", world_ranks=(0, 1, 2))
    assert "ZeRO stage 3: test." in text
    assert "diverged at ZeRO-3 collective #1" in text
    assert "rank 0 runs forward of 'a'" in text and "rank 1 runs forward of 'b'" in text
    assert "rank 2: unknown (it did not answer)" in text
    stopped = describe_divergence({0: _events(["t", "a"]), 1: _events(["t"])}, cause="c",
                                  world_ranks=(0, 1))
    assert "rank 1 never reached it (its last was #0 forward of 't'" in stopped


def test_guard_settings_from_env() -> None:
    assert GuardSettings.from_env({}).mode == "check"
    assert GuardSettings.from_env({"DSRUN_ZERO_DEBUG": "1"}).mode == "debug"
    assert GuardSettings.from_env({"DSRUN_ZERO_DEBUG": "off"}).mode == "off"
    assert GuardSettings.from_env({"DSRUN_ZERO_TIMEOUT": "2.5"}).timeout_s == 2.5
    with pytest.raises(DsrunConfigError, match="DSRUN_ZERO_DEBUG"):
        GuardSettings.from_env({"DSRUN_ZERO_DEBUG": "maybe"})
    with pytest.raises(DsrunConfigError, match="DSRUN_ZERO_TIMEOUT"):
        GuardSettings.from_env({"DSRUN_ZERO_TIMEOUT": "soon"})
    with pytest.raises(DsrunConfigError, match="timeout_s"):
        GuardSettings(timeout_s=0)


# ------------------------------------------------------ rank-major layout


@pytest.mark.parametrize("numel,world", [(5, 4), (8, 4), (1, 3), (7, 1), (9, 2)])
def test_write_rank_major(numel: int, world: int) -> None:
    spec = ShardSpec(numel, world)
    flat = torch.arange(1.0, numel + 1)
    rows = torch.full((world, spec.shard_numel + 2), -1.0)
    write_rank_major(rows[:, 1:1 + spec.shard_numel], flat, spec, 0.5)
    padded = torch.zeros(spec.padded_numel)
    padded[:numel] = flat * 0.5
    assert torch.equal(rows[:, 1:1 + spec.shard_numel], padded.view(world, -1))
    assert (rows[:, 0] == -1).all() and (rows[:, -1] == -1).all()  # nothing outside
