"""Pipeline topology and layer partitioning (pure): properties and cases."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsrun.errors import DsrunConfigError
from dsrun.runtime import utils as rt_utils
from dsrun.runtime.pipe.partition import (
    check_boundaries,
    layer_weights,
    partition_balanced,
    partition_deepspeed,
    partition_layers,
    partition_uniform,
)
from dsrun.runtime.pipe.topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    PipeTopology,
    ProcessTopology,
    default_topology,
    topology_for,
)


def brute_force_bottleneck(weights: list[int], parts: int) -> int:
    n = len(weights)
    best = None
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))
        best = worst if best is None else min(best, worst)
    assert best is not None
    return best


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=9), st.integers(1, 9))
def test_balanced_partition_is_optimal_and_valid(weights: list[int], parts: int) -> None:
    if len(weights) < parts:
        with pytest.raises(ValueError):
            partition_balanced(weights, parts)
        return
    bounds = partition_balanced(weights, parts)
    assert len(bounds) == parts + 1 and bounds[0] == 0 and bounds[-1] == len(weights)
    assert all(a < b for a, b in zip(bounds, bounds[1:])), "every stage owns a layer"
    worst = max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))
    assert worst == brute_force_bottleneck(weights, parts)


def test_balanced_cases() -> None:
    # Linear(784,128) + ReLU + Linear(128,10): the ReLU joins the first stage
    assert partition_balanced([100480, 0, 1290], 2) == (0, 2, 3)
    assert partition_balanced([1, 1, 1, 1], 2) == (0, 2, 4)
    assert partition_balanced([1, 1, 1, 1, 1], 2) == (0, 3, 5)
    assert partition_balanced([5], 1) == (0, 1)
    assert partition_balanced([0, 0, 0], 3) == (0, 1, 2, 3)


# DeepSpeed 0.19.8's deepspeed.runtime.utils.partition_balanced(weights, parts),
# computed with DeepSpeed itself (the bench's DeepSpeed venv, CPU accelerator)
DEEPSPEEDS_CUTS = [
    ([1, 1, 1, 1, 1, 1, 1], 3, (0, 3, 5, 7)),
    ([100, 10, 10, 10, 10, 10, 100], 4, (0, 1, 4, 6, 7)),
    ([0, 1, 1, 1, 1, 1, 1, 0], 3, (0, 3, 5, 8)),
    ([64, 72, 72, 72, 72, 36], 3, (0, 2, 4, 6)),
    ([100480, 0, 1290], 2, (0, 2, 3)),
    ([1, 9, 2, 5], 3, (0, 2, 3, 4)),
    ([0, 0, 7, 1, 1, 1, 4], 3, (0, 3, 6, 7)),
    ([5, 1, 1, 1, 1, 5], 2, (0, 3, 6)),
    ([3, 3, 3, 3, 3, 3, 3, 3, 3, 3], 4, (0, 3, 6, 8, 10)),
    ([100, 5, 100, 100, 100, 50, 0, 10], 4, (0, 2, 3, 4, 8)),
    ([1, 0, 5, 10, 1], 2, (0, 3, 5)),
    ([50, 1, 0, 100, 1, 10, 5], 2, (0, 3, 7)),
    ([1, 0, 1, 50, 50], 5, (0, 1, 2, 3, 4, 5)),
    ([1, 0, 0, 1, 1, 1, 1], 3, (0, 4, 6, 7)),
    ([1, 50, 100, 100, 1, 1], 4, (0, 2, 3, 4, 6)),
]


@pytest.mark.parametrize("weights, parts, cuts", DEEPSPEEDS_CUTS)
def test_parameters_and_type_cut_where_deepspeed_cuts(weights: list[int], parts: int,
                                                      cuts: tuple[int, ...]) -> None:
    assert partition_deepspeed(weights, parts) == cuts
    names = ["Block" if w else "Act" for w in weights]
    assert partition_layers("parameters", parts, names, weights) == cuts
    if set(weights) <= {0, 1}:  # "type:" weighs the matching layers 1, the others 0
        assert partition_layers("type:block", parts, names, [0] * len(weights)) == cuts


def test_equal_layers_split_as_uniform_does() -> None:
    """7 equal layers on 3 stages: 3 | 2 | 2 by every method, as in DeepSpeed
    (dsrun's bottleneck-first cut gave 3 | 3 | 1)."""
    names = ["Linear"] * 7
    for method in ("parameters", "type:Linear", "uniform"):
        assert partition_layers(method, 3, names, [20] * 7) == (0, 3, 5, 7), method
    assert partition_layers("flops", 3, names, [20] * 7, [5] * 7) == (0, 3, 5, 7)


def _least_spread_by_search(weights: list[int], parts: int) -> tuple[int, ...]:
    """DeepSpeed's rule by exhaustive search: among all cuts into non-empty
    parts, the least heaviest-minus-lightest spread; ties go to the later
    cut of the last part, then (recursively) of the parts before it."""
    n = len(weights)

    def spread(cuts: tuple[int, ...]) -> int:
        sums = [sum(weights[a:b]) for a, b in zip(cuts, cuts[1:])]
        return max(sums) - min(sums)

    best: dict[tuple[int, int], tuple[int, ...]] = {}
    for i in range(1, n + 1):  # the first i items in j parts, as the programme grows
        best[(i, 1)] = (0, i)
    for j in range(2, parts + 1):
        for i in range(j, n + 1):
            candidates = [best[(k, j - 1)] + (i,) for k in range(j - 1, i)]
            least = min(spread(c) for c in candidates)
            best[(i, j)] = [c for c in candidates if spread(c) == least][-1]
    return best[(n, parts)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 60), min_size=1, max_size=9), st.integers(1, 5))
def test_deepspeed_cut_is_deepspeeds_dynamic_programme(weights: list[int], parts: int) -> None:
    """The cut equals the one DeepSpeed's dynamic programme makes (least
    spread of the first i items in j parts, later cut on ties), here by
    search over the programme's candidates; runtime.utils gives the same."""
    if len(weights) < parts:
        with pytest.raises(ValueError):
            partition_deepspeed(weights, parts)
        return
    expected = _least_spread_by_search(weights, parts)
    assert partition_deepspeed(weights, parts) == expected
    assert rt_utils.partition_balanced(weights, parts) == list(expected)


def test_flops_takes_deepspeeds_cut_among_the_lightest_bottlenecks() -> None:
    # DeepSpeed's least spread, 10 | 2 | 5, is heavier than 1 | 9 | 7
    assert partition_deepspeed([1, 9, 2, 5], 3) == (0, 2, 3, 4)
    assert partition_balanced([1, 9, 2, 5], 3) == (0, 1, 2, 4)
    # bottleneck 100 either way: DeepSpeed's 100 | 30 | 20 | 100, not 100 | 40 | 10 | 100
    assert partition_balanced([100, 10, 10, 10, 10, 10, 100], 4) == (0, 1, 4, 6, 7)


def test_methods() -> None:
    names = ["Embedding", "Block", "Block", "Block", "Block", "LayerNorm", "Head"]
    counts = [100, 10, 10, 10, 10, 1, 100]
    assert partition_layers("parameters", 2, names, counts) == (0, 3, 7)  # 120 | 121
    assert partition_layers("uniform", 2, names, counts) == (0, 4, 7)
    # DeepSpeed's boundaries: the first (22 mod 3) stages one layer more
    assert partition_layers("Uniform", 3, ["L"] * 22, [0] * 22) == (0, 8, 15, 22)
    # two blocks per stage, whatever the embedding and head weigh
    bounds = partition_layers("type:block", 2, names, counts)
    assert [sum(n == "Block" for n in names[a:b]) for a, b in zip(bounds, bounds[1:])] == [2, 2]
    assert partition_layers("TYPE:^Bl", 4, names, counts)[1:4] == (2, 3, 4)
    assert partition_layers([0, 1, 6, 7], 3, names, counts) == (0, 1, 6, 7)
    assert layer_weights("Parameters", names, counts) == counts


@pytest.mark.parametrize("method, message", [
    ("flop", "unknown partition_method='flop'"),
    ("profile", "not implemented"),
    ("type:Conv", "no layer class name matches 'Conv'"),
    ("type:(", "not a valid regular expression"),
    ([0, 7], "need num_stages + 1 = 3 integers"),
    ([0, 0, 7], "stage 0 would own no layer"),
    ([1, 3, 7], "must start at 0"),
    ([0, 2.5, 7], "must be integers"),
    (3, "must be a string or a sequence"),
])
def test_bad_methods_name_the_problem(method: object, message: str) -> None:
    with pytest.raises(DsrunConfigError, match=message.replace("(", r"\(").replace(
            "+", r"\+")):
        partition_layers(method, 2, ["Block"] * 7, [1] * 7)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 40), st.integers(1, 8))
def test_uniform_is_deepspeeds_partition(layers: int, parts: int) -> None:
    if layers < parts:
        return
    bounds = partition_uniform(layers, parts)
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    # DeepSpeed's partition_uniform: equal chunks, the remainder added from the front
    expected = [0] + [layers // parts * p for p in range(1, parts + 1)]
    for i in range(layers % parts):
        expected[i + 1:] = [b + 1 for b in expected[i + 1:]]
    assert list(bounds) == expected
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_more_stages_than_layers() -> None:
    with pytest.raises(DsrunConfigError, match="2 layer.s. cannot fill 3 pipeline stages"):
        partition_layers("uniform", 3, ["A", "B"], [1, 1])
    with pytest.raises(DsrunConfigError):
        check_boundaries([0, 1], 1, 2)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6))
def test_topology_is_a_bijection_with_disjoint_groups(stages: int, replicas: int) -> None:
    topo = PipeTopology(stages, replicas)
    ranks = range(topo.world_size())
    assert sorted(topo.rank(*topo.coords(r)) for r in ranks) == list(ranks)
    stage_groups = [topo.stage_ranks(s) for s in range(stages)]
    pipe_groups = [topo.pipeline_ranks(r) for r in range(replicas)]
    for groups in (stage_groups, pipe_groups):
        assert sorted(r for g in groups for r in g) == list(ranks)
    for s, group in enumerate(stage_groups):
        assert all(topo.coords(r)[0] == s for r in group)


def test_topology_layout_is_deepspeeds() -> None:
    topo = PipeDataParallelTopology(num_pp=2, num_dp=2)
    assert topo.stage_ranks(0) == (0, 1) and topo.stage_ranks(1) == (2, 3)
    assert topo.pipeline_ranks(1) == (1, 3)
    assert topo.coords(2) == (1, 0)
    assert PipeModelDataParallelTopology(2, 1, 3) == PipeTopology(2, 3)


def test_deepspeeds_topology_queries() -> None:
    topo = PipeDataParallelTopology(num_pp=2, num_dp=3)
    assert isinstance(topo, ProcessTopology) and topo.world_size() == 6
    assert topo.get_axis_names() == ["pipe", "data"]
    assert (topo.get_dim("pipe"), topo.get_dim("data"), topo.get_dim("model")) == (2, 3, 0)
    assert topo.get_rank(pipe=1, data=2) == 5 == topo.rank(1, 2)
    assert topo.get_coord(4) == (1, 1) and topo.get_coord(4).data == 1
    assert topo.filter_match(pipe=0) == [0, 1, 2] == topo.get_axis_list("pipe", 0)
    assert topo.get_axis_comm_lists("pipe") == [[0, 3], [1, 4], [2, 5]]
    assert topo.get_axis_comm_lists("data") == [[0, 1, 2], [3, 4, 5]]
    assert topo.get_axis_comm_lists("model") == []
    with pytest.raises(ValueError, match="needs a coordinate for each axis"):
        topo.get_rank(pipe=1)
    with pytest.raises(ValueError, match="no axis model"):
        topo.filter_match(model=0)
    three = PipeModelDataParallelTopology(2, 1, 2)
    assert three.get_axis_names() == ["pipe", "data", "model"]
    assert three.get_rank(pipe=1, data=0, model=0) == 2
    assert three.get_rank_repr(3, omit_axes=["data"]) == "pipe_01-model_00"
    # a general grid, last axis fastest (DeepSpeed's docstring examples)
    grid = ProcessTopology(axes=["x", "y"], dims=[2, 3])
    assert grid.get_axis_list("x", 0) == [0, 1, 2] and grid.get_axis_list("y", 0) == [0, 3]
    assert [tuple(grid.get_coord(r)) for r in range(6)] == \
        [(x, y) for x in range(2) for y in range(3)]
    with pytest.raises(DsrunConfigError, match="one size per axis"):
        ProcessTopology(["a", "b"], [2])


def test_a_process_topology_as_a_pipelines() -> None:
    assert topology_for(4, None, ProcessTopology(["pipe", "data"], [2, 2])) == PipeTopology(2, 2)
    assert topology_for(2, 2, ProcessTopology(["pipe", "data", "model"], [2, 1, 1])).stages == 2
    with pytest.raises(DsrunConfigError, match=r"axes \['pipe', 'data'\] in that order"):
        topology_for(4, None, ProcessTopology(["data", "pipe"], [2, 2]))


@pytest.mark.parametrize("world, stages, topology, message", [
    (4, 3, None, "num_stages=3 does not divide the world size 4"),
    (4, None, None, "needs num_stages="),
    (4, 0, None, "num_stages must be a positive integer"),
    (4, 3, PipeTopology(2, 2), "num_stages=3 disagrees"),
    (6, None, PipeTopology(2, 2), "does not match the world size 6"),
    (4, None, "2x2", "must be a PipeDataParallelTopology"),
])
def test_bad_topologies(world: int, stages: object, topology: object, message: str) -> None:
    with pytest.raises(DsrunConfigError, match=message):
        topology_for(world, stages, topology)


def test_topologies_from_either_argument() -> None:
    assert topology_for(4, 2) == PipeTopology(2, 2)
    assert topology_for(4, None, PipeTopology(4, 1)) == PipeTopology(4, 1)
    assert topology_for(4, 4, PipeTopology(4, 1)) == PipeTopology(4, 1)
    with pytest.raises(DsrunConfigError, match="tensor .model. parallelism"):
        PipeModelDataParallelTopology(2, 2, 1)


@pytest.mark.parametrize("world, stages, replicas", [
    (1, 1, 1), (2, 2, 1), (4, 2, 2), (6, 2, 3), (7, 7, 1), (8, 4, 2), (12, 6, 2),
    (30, 10, 3), (16, 4, 4)])
def test_default_topology_deals_prime_factors_as_deepspeed(world: int, stages: int,
                                                           replicas: int) -> None:
    """DeepSpeed's PipelineParallelGrid without a topology: prime factors,
    smallest first, alternately to stages and replicas."""
    assert default_topology(world) == PipeTopology(stages, replicas)
