"""PipelineModule and PipelineEngine in one process (world size 1, one stage)
and the errors a pipeline reports; one 2-rank job for an error that only a
real stage boundary can show."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dsrun
from dsrun.errors import DsrunConfigError, DsrunError
from dsrun.pipe import LayerSpec, PipelineEngine, PipelineModule, TiedLayerSpec
from dsrun.runtime.pipe import batch as pipe_batch
from dsrun.runtime.utils import set_random_seed
from tests.conftest import ROOT, run_dsrun
from tests.dist.pipe_support import load_cases

pytestmark = pytest.mark.dist
cases = load_cases()


def _engine(name: str = "mlp", **overrides: Any) -> tuple[PipelineEngine, Any]:
    case = cases.CASES[name]
    config = {**case.config(), **overrides}
    engine, _, _, _ = dsrun.initialize(model=cases.build(name, 1), config=config)
    assert isinstance(engine, PipelineEngine)
    return engine, case


# ---------------------------------------------------------------- the module


def test_names_do_not_depend_on_the_partition(solo: None) -> None:
    module = cases.build("tied", 1)
    assert sorted(n for n, _ in module.named_parameters()) == [
        "1.down.bias", "1.down.weight", "1.up.bias", "1.up.weight", "2.down.bias",
        "2.down.weight", "2.up.bias", "2.up.weight", "3.bias", "3.weight",
        "tied_modules.embed.weight"]
    mlp = cases.build("mlp", 1)
    assert sorted(mlp.state_dict()) == ["0.linear.bias", "0.linear.weight", "1.linear.bias",
                                        "1.linear.weight", "3.bias", "3.weight", "5.bias",
                                        "5.weight"]


def test_seed_layers_seeds_each_layer_as_deepspeed(solo: None) -> None:
    """What DeepSpeed 0.19.8 does on the CPU: set_random_seed(base_seed + i)
    (Python's, numpy's and torch's generators) before building layer i,
    and the generators are left where the last layer's build left them."""
    module = cases.build("mlp", 1)
    after = (torch.rand(3), random.random(), float(numpy.random.rand()))
    set_random_seed(1234 + 5)  # the last layer's seed, then its build
    nn.Linear(9, 5)
    assert torch.equal(after[0], torch.rand(3))
    assert after[1:] == (random.random(), float(numpy.random.rand()))
    set_random_seed(1234 + 3)
    assert torch.equal(module.get_submodule("3").weight, nn.Linear(9, 9).weight)
    tied = cases.build("tied", 1)
    set_random_seed(1234 + 0)  # a tied module: its first layer's index
    assert torch.equal(tied.tied_modules["embed"].weight, nn.Embedding(11, 8).weight)
    seeds: list[int] = []  # seed_fn= is called instead, before every layer
    PipelineModule(cases.mlp_layers(), num_stages=1, seed_layers=True, seed_fn=seeds.append)
    assert seeds == [1234 + i for i in range(6)]


class Noisy(nn.Module):
    """A layer that draws random numbers in its forward (dropout)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.linear(x), 0.5, self.training)


def test_seed_layers_reseeds_every_forward_as_deepspeed(solo: None) -> None:
    """DeepSpeed reseeds before running layer i in forward call n with
    base_seed * (n + 1) + i (micro_offset is n), so a recomputation under
    activation checkpointing draws the same dropout masks; dsrun numbers a
    checkpointed chunk's layers by their index (DeepSpeed from the stage's
    first layer in every chunk)."""
    seeds: list[int] = []
    layers = [LayerSpec(Noisy), cases.double, LayerSpec(Noisy), LayerSpec(Noisy)]
    module = PipelineModule(layers, num_stages=1, seed_layers=True, seed_fn=seeds.append,
                            base_seed=10, activation_checkpoint_interval=2)
    seeds.clear()
    x = torch.randn(2, 4)
    with torch.no_grad():
        module(x)
        module(x)
    assert seeds == [10 * 2 + i for i in range(4)] + [10 * 3 + i for i in range(4)]
    assert (module.micro_offset, module.curr_layer) == (2, 3)
    seeds.clear()
    module(x).sum().backward()  # both chunks recomputed with the same seeds
    # (torch stops a recomputation once it has what backward needs)
    assert seeds[:4] == [40, 41, 42, 43] and seeds[4:7] == [42, 43, 40]
    # the masks: the module run by hand with set_random_seed, checkpointed or not
    plain = PipelineModule(layers, num_stages=1, seed_layers=True)
    ckpt = PipelineModule(layers, num_stages=1, seed_layers=True,
                          activation_checkpoint_interval=1)
    h = x
    for i, layer in enumerate([plain.get_submodule("0"), cases.double, plain.get_submodule("2"),
                               plain.get_submodule("3")]):
        set_random_seed(1234 * 2 + i)
        h = layer(h)
    out = plain(x)
    assert torch.equal(out, h)
    out.sum().backward()
    torch.manual_seed(0)  # whatever the generators hold: every layer reseeds
    again = ckpt(x)
    assert torch.equal(again, out)
    again.sum().backward()  # recomputed: the same masks again, the same gradients
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(),
                                                           ckpt.parameters()))


def test_forward_runs_the_layers_in_order(solo: None) -> None:
    module = cases.build("mlp", 1)
    x = torch.randn(3, 6)
    h = x
    for i in (0, 1):
        h = module.get_submodule(str(i))(h)
    h = torch.tanh(module.get_submodule("3")(2 * h))
    assert torch.equal(module(x), module.get_submodule("5")(h))


class Counting(nn.Module):
    calls = 0

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Counting.calls += 1
        return torch.tanh(self.linear(x))


def _saved_bytes(module: nn.Module, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x).square().sum()
    out.backward()
    return sum(saved), torch.cat([p.grad.reshape(-1) for p in module.parameters()])


@pytest.mark.parametrize("interval", [1, 2, 3])
def test_activation_checkpointing_recomputes_and_keeps_less(solo: None, interval: int) -> None:
    specs = [LayerSpec(Counting) for _ in range(6)]
    plain = PipelineModule(specs, num_stages=1, seed_layers=True)
    ckpt = PipelineModule(specs, num_stages=1, seed_layers=True,
                          activation_checkpoint_interval=interval)
    x = torch.randn(32, 16)
    Counting.calls = 0
    plain_bytes, plain_grads = _saved_bytes(plain, x)
    assert Counting.calls == 6
    Counting.calls = 0
    ckpt_bytes, ckpt_grads = _saved_bytes(ckpt, x)
    assert Counting.calls == 12  # every layer ran again during backward
    assert torch.equal(plain_grads, ckpt_grads)
    assert ckpt_bytes < plain_bytes / 2, (ckpt_bytes, plain_bytes)
    Counting.calls = 0
    with torch.no_grad():
        ckpt(x)
    assert Counting.calls == 6  # no checkpointing without gradients


def test_checkpointable_layers_limits_which_chunks(solo: None) -> None:
    specs = [LayerSpec(Counting), LayerSpec(nn.Linear, 16, 16)]
    module = PipelineModule(specs, num_stages=1, activation_checkpoint_interval=1,
                            checkpointable_layers=["Linear"])
    Counting.calls = 0
    module(torch.randn(2, 16)).sum().backward()
    assert Counting.calls == 1  # the Counting chunk was not checkpointed


def embed_logits(embedding: nn.Embedding, h: torch.Tensor) -> torch.Tensor:
    return h @ embedding.weight.t()


@pytest.mark.parametrize("layers, kwargs, message", [
    ("abc", {}, "layers= must be a sequence"),
    ([], {}, "at least one layer"),
    ([LayerSpec(nn.ReLU), 3], {}, "layer 1 is a int"),
    ([TiedLayerSpec("e", nn.Embedding, 4, 2), TiedLayerSpec("e", nn.Linear, 2, 4)], {},
     "layer 1: TiedLayerSpec 'e' builds Linear, but layer 0"),
    ([LayerSpec(nn.ReLU)], {"num_stages": 2}, "num_stages=2 does not divide the world size 1"),
    ([LayerSpec(nn.ReLU)], {"activation_checkpoint_interval": -1}, "must be an integer >= 0"),
    ([LayerSpec(nn.ReLU)], {"loss_fn": "mse"}, "loss_fn must be callable"),
    ([LayerSpec(nn.ReLU)], {"partition_method": "fastest"}, "unknown partition_method"),
    ([TiedLayerSpec("e", nn.ReLU)], {}, "ReLU has no parameter 'weight'"),
])
def test_bad_modules_name_the_problem(solo: None, layers: Any, kwargs: dict,
                                      message: str) -> None:
    kwargs.setdefault("num_stages", 1)
    with pytest.raises(DsrunConfigError, match=message):
        PipelineModule(layers, **kwargs)


def test_bad_specs(solo: None) -> None:
    with pytest.raises(DsrunConfigError, match="torch.nn.Module subclass"):
        LayerSpec(len)
    with pytest.raises(DsrunConfigError, match="without dots"):
        TiedLayerSpec("a.b", nn.Linear, 2, 2)
    with pytest.raises(DsrunConfigError, match="tied_weight_attr must be"):
        TiedLayerSpec("a", nn.Linear, 2, 2, tied_weight_attr=[])
    layer = nn.Linear(2, 2)
    with pytest.raises(DsrunConfigError, match="same module object as layer 0: to share"):
        PipelineModule([layer, layer], num_stages=1)


def test_flops_partition_needs_an_example_and_reports_the_work(solo: None) -> None:
    with pytest.raises(DsrunConfigError, match="'flops' needs example_inputs="):
        PipelineModule([LayerSpec(nn.Linear, 4, 4)], num_stages=1, partition_method="flops")
    module = PipelineModule([LayerSpec(nn.Linear, 4, 8, bias=False), nn.ReLU()], num_stages=1,
                            partition_method="flops", example_inputs=torch.zeros(2, 4),
                            activation_checkpoint_interval=1)
    # the linear's forward (counted twice: checkpointed), its weight's gradient, the relu's two
    assert module.layer_flops == [3 * 2 * 2 * 4 * 8, 2 * 2 * 8]
    assert "stage 0: layers 0-1 (Linear, ReLU), 4.16e-07 GFLOP per micro-batch" in \
        module.describe(["Linear", "ReLU"], None)


# ---------------------------------------------------------------- the engine


def test_train_batch_is_the_plain_loop_at_world_size_one(solo: None) -> None:
    engine, case = _engine("mlp-noclip")
    ref = cases.build("mlp-noclip", 1)
    opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.01)
    for step in range(3):
        total = torch.zeros(())
        for x, y in case.batch(step, 0):
            loss = F.cross_entropy(ref(x), y)
            (loss / case.micro_batches).backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        assert float(engine.train_batch(iter(case.batch(step, 0)))) == \
            float(total / case.micro_batches)
    assert all(torch.equal(a, b) for a, b in zip(engine.module.parameters(), ref.parameters()))
    # DeepSpeed's counters: micro_steps counts engine.step() calls, none here
    assert (engine.global_steps, engine.micro_steps, engine.global_samples) == (3, 0, 48)
    tput = engine.tput_timer  # one interval per train_batch, the first two left out (warm-up)
    assert (tput.batch_size, tput.global_step_count, tput.micro_step_count) == (16, 3, 3)
    assert tput.total_elapsed_time > 0 and not tput.started and tput.avg_samples_per_sec() > 0


def test_eval_and_inference_passes(solo: None) -> None:
    engine, case = _engine("mlp")
    data = case.eval_data()
    with torch.no_grad():
        outs = [engine.module(x) for x, _ in data]
        losses = torch.stack([F.cross_entropy(o, y) for o, (_, y) in zip(outs, data)])
    loss, logits = engine.eval_batch(iter(data), return_logits=True)
    assert float(loss) == pytest.approx(float(losses.mean()), abs=1e-7)
    assert torch.equal(logits, outs[-1])  # the last micro-batch's output, as DeepSpeed
    per = engine.eval_batch(iter(data), reduce_output=None)
    assert [float(v) for v in per] == pytest.approx([float(v) for v in losses], abs=1e-7)
    # without the loss: the outputs, averaged over the micro-batches (or each of them)
    averaged = engine.eval_batch(iter(data), compute_loss=False)
    assert torch.allclose(averaged, torch.stack(outs).mean(0), atol=1e-7, rtol=0)
    each = engine.eval_batch(iter(data), compute_loss=False, reduce_output=None)
    assert all(torch.equal(a, b) for a, b in zip(each, outs))
    # the last stage (here the only one) keeps its result without the broadcast
    local = engine.eval_batch(iter(data), bcast_loss=False)
    assert float(local) == pytest.approx(float(losses.mean()), abs=1e-7)
    assert torch.equal(engine(data[0][0]), outs[0])
    assert not engine.module.training  # left in eval mode, as DeepSpeed
    engine.train_batch(iter(case.batch(0, 0)))
    assert engine.module.training


def test_eval_without_a_loss_function(solo: None) -> None:
    module = PipelineModule([LayerSpec(nn.Linear, 6, 5)], num_stages=1)
    engine, _, _, _ = dsrun.initialize(model=module, config=cases.CASES["mlp"].config())
    data = cases.CASES["mlp"].eval_data()
    with torch.no_grad():
        expected = torch.stack([module(x) for x, _ in data]).mean(0)
    # the output is the "loss": averaged, kept on the last stage
    assert torch.allclose(engine.eval_batch(iter(data), bcast_loss=False), expected,
                          atol=1e-7, rtol=0)
    with pytest.raises(DsrunError, match="single-element tensor to be sent to every stage; "
                                         "pass bcast_loss=False"):
        engine.eval_batch(iter(data))


def test_the_data_iterator_persists_as_in_deepspeed(solo: None) -> None:
    engine, case = _engine("mlp-noclip")
    given = iter(case.batch(0, 0) + case.batch(1, 0))
    first = engine.train_batch(given)
    assert engine.data_iterator is given
    engine.eval_batch(iter(case.eval_data()))  # reads its own data, not the training iterator
    second = engine.train_batch()  # goes on with the iterator given before
    with pytest.raises(StopIteration, match="ran out at micro-batch 0 of 4"):  # DeepSpeed's
        engine.train_batch()
    fresh, _ = _engine("mlp-noclip")
    assert [float(fresh.train_batch(iter(case.batch(step, 0)))) for step in (0, 1)] == \
        [float(first), float(second)]
    for name, call in (("train_batch", lambda: engine.train_batch(case.batch(0, 0))),
                       ("eval_batch", lambda: engine.eval_batch(case.eval_data())),
                       ("set_dataiterator", lambda: engine.set_dataiterator(case.batch(0, 0)))):
        with pytest.raises(DsrunError, match=rf"^engine\.{name}\(data_iter=\.\.\.\) takes an "
                                             r"iterator, got a list: pass iter\(\.\.\.\) "
                                             r"of it, or RepeatingLoader"):
            call()
    with pytest.raises(DsrunError, match=r"eval_batch\(data_iter\) needs the data"):
        engine.eval_batch(None)
    repeating = deepspeed_utils().RepeatingLoader(case.batch(2, 0)[:3])  # 3 per "epoch"
    engine.train_batch(repeating)
    engine.train_batch()  # 4 more: the list again from its second item
    assert engine.data_iterator is repeating


def deepspeed_utils() -> Any:
    from deepspeed import utils  # the alias (import dsrun above installs it)
    return utils


def test_a_reentrant_checkpoint_trains_the_first_stage(solo: None) -> None:
    """torch's reentrant checkpoint keeps no graph to inputs that do not
    require grad: the first stage marks its floating-point inputs (as
    DeepSpeed), else its layers get no gradient (at world size 1 the loss
    would have none)."""
    import functools

    from dsrun import checkpointing

    case = cases.CASES["mlp-noclip"]
    reference, _ = _engine("mlp-noclip")
    module = PipelineModule(layers=case.layers(), num_stages=1, loss_fn=case.loss_fn,
                            seed_layers=True, activation_checkpoint_interval=1,
                            activation_checkpoint_func=functools.partial(
                                torch.utils.checkpoint.checkpoint, use_reentrant=True))
    engine, _, _, _ = dsrun.initialize(model=module, config=case.config())
    for step in range(2):
        assert float(engine.train_batch(iter(case.batch(step, 0)))) == \
            float(reference.train_batch(iter(case.batch(step, 0))))
    assert all(torch.equal(a, b) for a, b in zip(engine.module.parameters(),
                                                 reference.module.parameters()))
    # the config's pipeline section picks the function and the interval, as DeepSpeed's
    configured, _ = _engine("mlp-noclip", pipeline={"activation_checkpoint_interval": 2,
                                                    "use_reentrant": True})
    assert configured.module.activation_checkpoint_interval == 2
    assert configured.module.activation_checkpoint_func.keywords == {"use_reentrant": True}
    plain, _ = _engine("mlp-noclip", pipeline={"use_reentrant": False})
    assert plain.module.activation_checkpoint_func is checkpointing.checkpoint
    assert plain.module.activation_checkpoint_interval == 0


def test_deepspeeds_module_engine_and_grid_accessors(solo: None) -> None:
    engine, case = _engine("mlp")
    module, grid = engine.module, engine.grid
    assert engine.mpu is grid  # DeepSpeed's: initialize() takes the module's mpu()
    assert module.topology() is grid.topology() and module.topology().get_dim("pipe") == 1
    assert module.num_pipeline_stages() == 1 and module.partitions() == (0, 6)
    assert [module.stage_owner(i) for i in range(6)] == [0] * 6
    with pytest.raises(ValueError, match="layer 6 is outside 0-5"):
        module.stage_owner(6)
    module.set_checkpoint_interval(2)
    assert module.activation_checkpoint_interval == 2
    assert module.get_additional_losses() is None
    assert (engine.micro_batch_size, engine.prev_stage, engine.next_stage) == (4, -1, 1)
    assert not engine.is_data_parallel and not engine.is_model_parallel
    assert grid.pp_group == [0] and grid.get_data_parallel_group_ranks() == [0]
    assert grid.get_global_rank() == 0 and grid.get_pipeline_model_parallel_world_size() == 1
    ones = torch.ones(3)
    torch.distributed.all_reduce(ones, group=grid.get_model_parallel_group())
    assert torch.equal(ones, torch.ones(3))  # a group of this rank alone
    PipelineModule([LayerSpec(nn.Linear, 2, 2)], num_stages=1, dynamic_shape=True)


def test_deepspeeds_megatron_style_engine_and_module_names(solo: None) -> None:
    """The PipelineEngine / PipelineModule attributes Megatron-DeepSpeed-style
    code reads, with their values in a one-stage pipeline."""
    engine, case = _engine("mlp-noclip")
    module = engine.module
    assert engine.total_loss is None and engine.num_pipe_buffers == 0 and module.micro_offset == 0
    assert engine.get_pipeline_parallel_rank() == 0
    assert not engine.is_pipe_partitioned and not engine.is_grad_partitioned
    assert not engine.has_bool_tensors and not engine.has_attention_mask
    engine.set_has_attention_mask(True)
    assert engine.has_attention_mask
    with pytest.raises(DsrunError, match="takes a bool, got int"):
        engine.set_has_attention_mask(1)  # type: ignore[arg-type]
    assert engine.pipeline_enable_backward_allreduce
    engine.pipeline_enable_backward_allreduce = True
    with pytest.raises(DsrunError, match="pipeline_enable_backward_allreduce = False is not"):
        engine.pipeline_enable_backward_allreduce = False
    # total_loss: the sum of the batch's micro-batch losses, before averaging
    ref = cases.build("mlp-noclip", 1)
    opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.01)
    for step in range(2):
        total = None
        for x, y in case.batch(step, 0):
            loss = F.cross_entropy(ref(x), y)
            (loss / case.micro_batches).backward()
            total = loss.detach() if total is None else total + loss.detach()
        opt.step()
        opt.zero_grad()
        engine.train_batch(iter(case.batch(step, 0)))
        assert torch.equal(engine.total_loss, total)
    engine.eval_batch(iter(case.eval_data()))
    assert torch.equal(engine.total_loss, total)  # a training batch's
    assert engine.num_pipe_buffers == 1  # one stage holds one micro-batch at a time
    assert module.micro_offset == 2 * case.micro_batches + len(case.eval_data())
    # batch_fn: set_batch_fn's function, the one state
    assert engine.batch_fn is None

    def to_pair(item: dict) -> tuple:
        return item["x"], item["y"]

    engine.set_batch_fn(to_pair)
    assert engine.batch_fn is to_pair
    engine.train_batch(iter({"x": x, "y": y} for x, y in case.batch(2, 0)))
    engine.batch_fn = None
    engine.train_batch(iter(case.batch(3, 0)))
    # the module: the world, its layers, DeepSpeed's file names
    assert (module.global_rank, module.local_rank, module.world_size) == (0, 0, 1)
    assert module.world_group is torch.distributed.group.WORLD
    assert module.tied_comms == {}  # one stage: nothing tied across stages (as DeepSpeed)
    assert module._find_layer_type("linear") == [3, 5]
    assert module._find_layer_type("AFFINE") == [0, 1]
    assert module._find_layer_type("^double$") == [2]  # a function's name
    with pytest.raises(DsrunConfigError, match="no layer class name matches 'conv'"):
        module._find_layer_type("conv")
    assert module.ckpt_layer_path("/ck", 4) == "/ck/layer_04-model_states.pt"
    from dsrun.pipe import PipeModelDataParallelTopology

    three_axes = PipelineModule(case.layers(), topology=PipeModelDataParallelTopology(1, 1, 1))
    assert three_axes.ckpt_layer_path("/ck", 0) == "/ck/layer_00-model_00-model_states.pt"


def test_deepspeeds_grid_names_and_constructor(solo: None) -> None:
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid

    from dsrun.pipe import PipeDataParallelTopology, ProcessTopology

    engine, _ = _engine()
    grid = engine.grid
    assert isinstance(grid, PipelineParallelGrid)
    assert (grid.pipe_parallel_size, grid.data_parallel_size, grid.model_parallel_size) == \
        (1, 1, 1)
    assert grid.p2p_groups == [[0, 0]]  # DeepSpeed's: the last stage wraps to the first
    assert grid.stage_to_global(stage_id=0) == grid.stage_to_global(0, data=0) == 0
    with pytest.raises(ValueError, match=r"model is not a coordinate besides the stage "
                                         r"\(the others are \['data'\]\)"):
        grid.stage_to_global(stage_id=0, model=0)
    built = PipelineParallelGrid()  # DeepSpeed's: a grid of the whole world
    assert built.topology() == PipeDataParallelTopology(1, 1) and built.stage_id == 0
    given = PipelineParallelGrid(topology=ProcessTopology(["pipe", "data"], [1, 1]),
                                 process_group=torch.distributed.group.WORLD)
    assert given.get_pipe_parallel_world_size() == 1 and given.p2p_groups == [[0, 0]]
    with pytest.raises(DsrunConfigError, match="does not match the world size 1"):
        PipelineParallelGrid(topology=PipeDataParallelTopology(2, 1))


def test_deepspeeds_grid_group_names(solo: None) -> None:
    """DeepSpeed's rank lists and process groups on the grid (its names;
    2 stages x 2 replicas: the 4-rank job below)."""
    grid = _engine()[0].grid
    assert (grid.dp_group, grid.dp_groups, grid.pp_group, grid.pipe_groups) == \
        ([0], [[0]], [0], [[0]])
    assert grid.get_data_parallel_group_ranks() == grid.dp_group
    assert grid.get_data_parallel_group() is grid.dp_proc_group
    assert grid.get_pipe_parallel_group() is grid.pp_proc_group
    assert grid.slice_group == [0] and grid.slice_proc_group is grid.get_slice_parallel_group()
    for group in (grid.dp_proc_group, grid.pp_proc_group, grid.slice_proc_group):
        assert torch.distributed.get_world_size(group) == 1


def test_counters_and_the_boundary_as_deepspeed(solo: None) -> None:
    """DeepSpeed 0.19.8's pipeline engine (run on the CPU): train_batch adds
    one global step and the batch's samples, micro_steps stays 0 (it counts
    engine.step() calls); eval_batch moves none of them;
    is_gradient_accumulation_boundary() is True only while the gradients
    are reduced or the optimizer steps, also with one micro-batch a batch."""
    for accumulation in (4, 1):
        engine, case = _engine("mlp-noclip", gradient_accumulation_steps=accumulation)
        seen: list[bool] = []
        engine.optimizer.register_step_pre_hook(
            lambda *_, seen=seen, engine=engine: seen.append(
                engine.is_gradient_accumulation_boundary()))
        engine.train_batch(iter(case.batch(0, 0)))
        counters = (engine.global_steps, engine.global_samples, engine.micro_steps)
        assert counters == (1, 4 * accumulation, 0)
        assert seen == [True] and not engine.is_gradient_accumulation_boundary()
        engine.eval_batch(iter(case.eval_data()))
        assert (engine.global_steps, engine.global_samples, engine.micro_steps) == counters
        engine.set_gradient_accumulation_boundary(True)  # DeepSpeed's pipeline ignores it
        assert not engine.is_gradient_accumulation_boundary()


def test_deepspeeds_module_attributes_and_methods(solo: None, tmp_path: Path) -> None:
    from dsrun.pipe import PipeModelDataParallelTopology

    mlp = cases.build("mlp", 1)
    assert mlp.fwd_map == {"0": 0, "1": 1, "3": 3, "4": 4, "5": 5}  # modules, not functions
    assert mlp.forward_funcs[mlp.fwd_map["3"]] is mlp.get_submodule("3")
    assert mlp.tied_weight_attrs == {} and mlp.checkpointable_layers is None
    tied = cases.build("tied", 1)
    assert tied.fwd_map == {"1": 1, "2": 2, "3": 3} and tied.tied_weight_attrs == {
        "embed": ["weight"]}
    # one stage: nothing is tied across stages (the 4-rank job has the rest)
    assert tied.get_tied_weights_and_groups() == []
    tied.allreduce_tied_weight_gradients()
    assert mlp.ckpt_prefix("/ck", "global_step3") == "/ck/global_step3/module-pipe_00"
    three_axes = PipelineModule(cases.mlp_layers(), topology=PipeModelDataParallelTopology(
        1, 1, 1))
    assert three_axes.ckpt_prefix("/ck", 7) == "/ck/7/module-pipe_00-model_00"
    names = ["layer_03-model_01-model_states.pt", "layer_03-model_00-model_states.pt",
             "layer_03-model_states.pt", "layer_04-model_00-model_states.pt",
             "layer_03-model_00-model_states.pt.tmp"]
    for name in names:
        (tmp_path / name).touch()
    assert mlp.ckpt_layer_path_list(str(tmp_path), 3) == [str(tmp_path / n) for n in (
        "layer_03-model_00-model_states.pt", "layer_03-model_01-model_states.pt",
        "layer_03-model_states.pt")]
    # compile(): each layer, as DeepSpeed (the stage's loop stays Python)
    x = torch.randn(3, 6)
    expected = mlp(x)
    mlp.compile(backend="eager")
    assert all(f._compiled_call_impl is not None for f in mlp.forward_funcs
               if isinstance(f, nn.Module))
    assert mlp.forward_funcs[2] is not cases.double and mlp.fwd_map["3"] == 3
    assert torch.equal(mlp(x), expected)


def test_misuse_raises_deepspeeds_exception_class(solo: None) -> None:
    """Where DeepSpeed 0.19.8 raises RuntimeError, AssertionError,
    NotImplementedError or TypeError, dsrun's error is one too (and a
    DsrunError with its own message)."""
    from dsrun.pipe import PipeDataParallelTopology

    engine, case = _engine("mlp")
    module = engine.module

    def without_grad() -> None:
        with torch.no_grad():
            engine.train_batch(iter(case.batch(0, 0)))

    calls: list[tuple[type, str, Any]] = [
        (RuntimeError, "gradients disabled", without_grad),
        (NotImplementedError, "reduce_output='sum'",
         lambda: engine.eval_batch(iter(case.eval_data()), reduce_output="sum")),
        (TypeError, "takes an iterator, got a list",
         lambda: engine.train_batch(case.batch(0, 0))),
        (TypeError, "needs the data", lambda: engine.eval_batch(None)),
        (AssertionError, "takes a bool", lambda: engine.set_has_attention_mask(1)),
        (AssertionError, "layer 6 is outside 0-5", lambda: module.stage_owner(6)),
        (AssertionError, "integer >= 0", lambda: module.set_checkpoint_interval(-1)),
        (RuntimeError, "no layer class name matches 'conv'",
         lambda: module._find_layer_type("conv")),
        (RuntimeError, "needs num_stages", lambda: PipelineModule(case.layers())),
        (RuntimeError, "does not divide the world size 1",
         lambda: PipelineModule(case.layers(), num_stages=2)),
        (AssertionError, "does not match the world size 1",
         lambda: PipelineModule(case.layers(), topology=PipeDataParallelTopology(2, 1))),
        (NotImplementedError, "'profile'",
         lambda: PipelineModule(case.layers(), num_stages=1, partition_method="profile")),
        (NotImplementedError, "a pipeline inside a pipeline",
         lambda: PipelineModule([module], num_stages=1)),
        (RuntimeError, "torch.nn.Module subclass", lambda: LayerSpec(int)),
        (TypeError, "torch.nn.Module subclass", lambda: LayerSpec(len)),
        (AssertionError, "ZeRO stage 3",
         lambda: _engine("mlp", zero_optimization={"stage": 3})),
    ]
    for kind, message, call in calls:
        with pytest.raises(kind, match=message) as info:
            call()
        assert isinstance(info.value, DsrunError), (kind, message)


def test_backward_and_step_point_to_train_batch(solo: None) -> None:
    from deepspeed.runtime.pipe.engine import PipelineError  # the alias: dsrun's class

    engine, case = _engine()
    for call in (lambda: engine.backward(torch.zeros(())), engine.step):
        with pytest.raises(PipelineError, match=r"engine.train_batch\(data_iter\)") as info:
            call()
        assert isinstance(info.value, DsrunError)
    with pytest.raises(DsrunError, match="exactly one argument"):
        engine(torch.zeros(2, 6), torch.zeros(2))


def test_training_data_and_batch_fn(solo: None) -> None:
    case = cases.CASES["mlp"]
    pairs = [case.data(k) for k in range(3)]
    dataset = torch.utils.data.TensorDataset(torch.cat([x for x, _ in pairs]),
                                             torch.cat([y for _, y in pairs]))
    engine, _, loader, _ = dsrun.initialize(model=cases.build("mlp", 1), config=case.config(),
                                            training_data=dataset)
    assert loader is not None
    first = engine.train_batch()  # 4 micro-batches from 3 per epoch: the loader repeats
    assert math.isfinite(float(first))
    seen = []
    engine.set_batch_fn(lambda item: (seen.append(1), (item["x"], item["y"]))[1])
    engine.train_batch(iter({"x": x, "y": y} for x, y in case.batch(0, 0)))
    assert len(seen) == case.micro_batches


@pytest.mark.parametrize("data, message", [
    (lambda c: iter(c.batch(0, 0)[:2]), "ran out at micro-batch 2 of 4"),
    (lambda c: iter([x for x, _ in c.batch(0, 0)]), "micro-batch 0 from the data iterator is "
                                                     "a Tensor"),
    (lambda c: iter([(x,) for x, _ in c.batch(0, 0)]), "a tuple of 1 items"),
    (lambda c: None, "needs data: pass data_iter="),
    (lambda c: iter([({"x": x}, y) for x, y in c.batch(0, 0)]), "inputs of micro-batch 0 is "
                                                                 "a dict"),
])
def test_bad_data_is_one_clear_error(solo: None, data: Any, message: str) -> None:
    engine, case = _engine()
    before = [p.detach().clone() for p in engine.module.parameters()]
    with pytest.raises(DsrunError, match=message):
        engine.train_batch(data(case))
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    assert all(p.grad is None for p in engine.module.parameters())  # none left to add to
    assert engine.global_steps == 0


def test_micro_batches_are_read_as_deepspeed_reads_them(
        solo: None, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Items past (inputs, labels) are ignored with one warning, and list
    inputs (default_collate's form of tuples) reach the first layer as a
    tuple - also through a reentrant activation checkpoint, which would cut
    a list off from autograd and leave the layer untrained."""

    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, xs: Any) -> torch.Tensor:
            assert isinstance(xs, tuple), type(xs)
            return self.lin(xs[0] + xs[1])

    def engine_of(interval: int) -> Any:
        torch.manual_seed(0)
        module = PipelineModule([LayerSpec(Pair)], num_stages=1, loss_fn=F.mse_loss,
                                activation_checkpoint_interval=interval,
                                activation_checkpoint_func=lambda f, *a: torch.utils.checkpoint
                                .checkpoint(f, *a, use_reentrant=True))
        return dsrun.initialize(model=module, config={
            "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "gradient_clipping": 0.0, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})[0]

    monkeypatch.setattr(pipe_batch, "_warned_extra", False)  # once per process
    g = torch.Generator().manual_seed(0)
    data = [((torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g)),
             torch.randn(2, 2, generator=g)) for _ in range(2)]
    pairs = engine_of(0)
    with caplog.at_level("WARNING", logger="dsrun.runtime"):
        as_lists = engine_of(1)
        loss = as_lists.train_batch(iter([[list(x), y, "id"] for x, y in data]))
    assert float(loss) == float(pairs.train_batch(iter(data)))
    assert [p.tolist() for p in as_lists.module.parameters()] == \
        [p.tolist() for p in pairs.module.parameters()]  # the checkpointed layer trained
    warned = [r.getMessage() for r in caplog.records if "are ignored" in r.getMessage()]
    assert len(warned) == 1 and "has 3 items" in warned[0], warned


def test_the_loss_must_be_a_scalar(solo: None) -> None:
    specs = [LayerSpec(nn.Linear, 6, 5)]
    module = PipelineModule(specs, num_stages=1)  # no loss_fn: the output is the loss
    engine, _, _, _ = dsrun.initialize(model=module, config=cases.CASES["mlp"].config())
    with pytest.raises(DsrunError, match=r"stage 0 \(layers 0-0\), micro-batch 0: without "
                       r"loss_fn, the last layer's output is the loss, and it is a tensor of "
                       r"shape \[4, 5\]") as info:
        engine.train_batch(iter(cases.CASES["mlp"].batch(0, 0)))
    assert isinstance(info.value, RuntimeError)  # DeepSpeed's backward() raises one


def test_a_failing_layer_says_where(solo: None) -> None:
    module = PipelineModule([LayerSpec(nn.Linear, 6, 5), LayerSpec(nn.Linear, 4, 5)],
                            num_stages=1, loss_fn=F.cross_entropy)
    engine, _, _, _ = dsrun.initialize(model=module, config=cases.CASES["mlp"].config())
    with pytest.raises(RuntimeError) as info:
        engine.train_batch(iter(cases.CASES["mlp"].batch(0, 0)))
    if sys.version_info >= (3, 11):  # exception notes
        assert "(in the forward pass of pipeline stage 0 (layers 0-1), micro-batch 0)" in \
            info.value.__notes__


@pytest.mark.parametrize("overrides, message", [
    ({"zero_optimization": {"stage": 3}}, "ZeRO stage 3 .* cannot be combined with pipeline"),
])
def test_zero3_is_refused(solo: None, overrides: dict, message: str) -> None:
    with pytest.raises(DsrunConfigError, match=message):
        _engine("mlp", **overrides)


def test_zero2_with_tied_layers_is_refused_and_mpu_too(solo: None) -> None:
    # one stage: the tied module has no copies, so stage 2 is fine
    engine, _ = _engine("tied", zero_optimization={"stage": 2})
    assert engine.zero_optimization_stage() == 2
    module = cases.build("tied", 1)
    with pytest.raises(AssertionError, match="do not pass mpu=") as caught:  # DeepSpeed's class
        dsrun.initialize(model=module, config=cases.CASES["tied"].config(), mpu=object())
    assert isinstance(caught.value, DsrunConfigError)


def test_fp16_overflow_skips_the_step_on_every_stage(solo: None) -> None:
    engine, case = _engine("mlp", fp16={"enabled": True, "initial_scale_power": 40,
                                        "hysteresis": 1, "auto_cast": True})
    before = [p.detach().clone() for p in engine.module.parameters()]
    loss = engine.train_batch(iter(case.batch(0, 0)))
    assert math.isfinite(float(loss))
    assert engine.skipped_steps == 1 and engine.precision.loss_scale == 2.0 ** 39
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    for step in range(1, 40):
        engine.train_batch(iter(case.batch(step, 0)))
    assert engine.skipped_steps < 40 and engine.was_step_applied()
    assert engine.module.get_submodule("5").weight.dtype == torch.float16


def test_clipping_matches_torch_at_world_size_one(solo: None) -> None:
    engine, case = _engine("mlp", gradient_clipping=0.05)
    ref = cases.build("mlp", 1)
    opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.01)
    for x, y in case.batch(0, 0):
        (F.cross_entropy(ref(x), y) / case.micro_batches).backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    opt.step()
    engine.train_batch(iter(case.batch(0, 0)))
    assert engine.get_global_grad_norm() == pytest.approx(float(norm), rel=1e-6)
    assert norm > 0.05  # clipping acted
    diff = max((a - b).abs().max().item() for a, b in zip(engine.module.parameters(),
                                                          ref.parameters()))
    assert diff <= 1e-6


def test_wall_clock_breakdown_measures_the_pipeline(solo: None) -> None:
    engine, case = _engine("mlp", wall_clock_breakdown=True)
    engine.train_batch(iter(case.batch(0, 0)))
    timing = engine.last_batch_timing
    assert timing is not None
    assert 0 < timing["compute_s"] <= timing["pipeline_s"] <= timing["total_s"]


def test_monitor_of_a_one_stage_pipeline(solo: None, tmp_path: Path) -> None:
    """World size 1: the loss rows are train_batch's, the norm measured for
    the monitor alone is torch's (get_global_grad_norm() stays None without
    clipping), eval_batch writes eval_loss, and the breakdown is written."""
    monitor = {"csv_monitor": {"enabled": True, "output_path": str(tmp_path),
                               "job_name": "one"}, "wall_clock_breakdown": True,
               "steps_per_print": 2}
    engine, case = _engine("mlp-noclip", **monitor)
    ref = cases.build("mlp-noclip", 1)
    for x, y in case.batch(0, 0):
        (F.cross_entropy(ref(x), y) / case.micro_batches).backward()
    want = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref.parameters()]))
    losses = [float(engine.train_batch(iter(case.batch(step, 0)))) for step in range(2)]
    assert engine.get_global_grad_norm() is None
    evaluated = float(engine.eval_batch(iter(case.eval_data())))

    def rows(name: str) -> list[tuple[int, float]]:
        text = (tmp_path / "one" / f"Train_Samples_{name}.csv").read_text().split()
        return [(int(a), float(b)) for a, b in (line.split(",") for line in text[1:])]
    assert rows("train_loss") == [(16, losses[0]), (32, losses[1])]
    assert rows("grad_norm")[0][1] == pytest.approx(float(want), rel=1e-6)
    assert rows("eval_loss") == [(32, evaluated)]
    assert [step for step, _ in rows("elapsed_time_ms_pipe_send")] == [32]


# ------------------------------------------------------- errors at a stage boundary

JOB = '''
import torch, torch.nn as nn
import dsrun
from dsrun.pipe import LayerSpec, PipelineModule

class ToDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
    def forward(self, x):
        return {"h": self.linear(x)}

dsrun.init_distributed()
module = PipelineModule([LAYERS], num_stages=2, loss_fn=nn.functional.cross_entropy)
engine, _, _, _ = dsrun.initialize(model=module, config={"train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
engine.train_batch(iter([(torch.randn(2, 4), torch.tensor([0, 1]))] * 2))
'''


@pytest.mark.parametrize("layers, message", [
    ("LayerSpec(ToDict), LayerSpec(nn.Linear, 4, 2)",
     "the output of pipeline stage 0 (layers 0-0), micro-batch 0 is a dict"),
    ("LayerSpec(nn.Linear, 4, 5), LayerSpec(nn.Linear, 4, 2)",  # stage 1 expects 4 features
     "(in the forward pass of pipeline stage 1 (layers 1-1), micro-batch 0)"),
])
def test_errors_at_a_stage_boundary_fail_the_job(tmp_path: Any, layers: str,
                                                 message: str) -> None:
    script = tmp_path / "bad_pipeline.py"
    script.write_text(JOB.replace("LAYERS", layers))
    res = run_dsrun("--cpu", "--num_gpus", "2", str(script), timeout=120, cwd=str(ROOT))
    assert res.returncode != 0
    if "forward pass" in message and sys.version_info < (3, 11):
        return  # exception notes are printed from Python 3.11 on
    assert message in res.stdout + res.stderr, res.stderr[-3000:]


# ------------------------------------------- DeepSpeed's names on 2 stages x 2 replicas

TIED_JOB = '''
import os
import torch, torch.nn as nn, torch.nn.functional as F
import torch.distributed as dist
import dsrun
from dsrun.pipe import LayerSpec, PipelineModule, TiedLayerSpec

dsrun.init_distributed()
rank = dist.get_rank()
stage, replica = divmod(rank, 2)  # rank = stage * replicas + replica
layers = [TiedLayerSpec("embed", nn.Linear, 4, 4), LayerSpec(nn.Linear, 4, 4), nn.ReLU(),
          TiedLayerSpec("embed", nn.Linear, 4, 4), TiedLayerSpec("head", nn.Linear, 4, 2)]
module = PipelineModule(layers, num_stages=2, loss_fn=F.cross_entropy,
                        partition_method=[0, 2, 5])
engine, _, _, _ = dsrun.initialize(model=module, config={"train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
grid = engine.grid
assert engine.get_pipeline_parallel_rank() == stage == grid.get_stage_id()
assert grid.p2p_groups == [[0, 2], [1, 3], [2, 0], [3, 1]], grid.p2p_groups
assert grid.stage_to_global(stage_id=1) == 2 + replica
assert grid.stage_to_global(stage_id=1, data=0) == 2 and grid.stage_to_global(0, data=1) == 1
assert (grid.pipe_parallel_size, grid.data_parallel_size) == (2, 2)
assert (module.global_rank, module.local_rank) == (rank, int(os.environ["LOCAL_RANK"]))
comms = module.tied_comms
# the ranks of this replica that hold each key, lowest stage first
assert sorted(comms) == (["embed"] if stage == 0 else ["embed", "head"]), comms
assert comms["embed"]["ranks"] == [replica, 2 + replica]
assert comms["embed"]["module"] is module.tied_modules["embed"]
assert comms["embed"]["weight_attr"] == ["weight"]
value = torch.tensor([float(rank)])
dist.all_reduce(value, group=comms["embed"]["group"])
assert float(value) == 2 * replica + 2  # its group is those ranks
if stage == 1:
    assert comms["head"]["ranks"] == [rank]  # one owner: a group of this rank alone
    alone = torch.tensor([float(rank)])
    dist.all_reduce(alone, group=comms["head"]["group"])
    assert float(alone) == rank
torch.manual_seed(7)  # every replica reads the same data: its mean is the batch's
data = [(torch.randn(2, 4), torch.tensor([0, 1])) for _ in range(2)]
loss = engine.train_batch(iter(data))
if stage == 1:  # the sum of this replica's micro-batch losses
    assert abs(float(engine.total_loss) / 2 - float(loss)) < 1e-6, (engine.total_loss, loss)
else:
    assert engine.total_loss is None  # as DeepSpeed: only the last stage computes losses
assert engine.num_pipe_buffers == (2 if stage == 0 else 1)  # 1F1B: stage 0 holds 2
assert (engine.global_steps, engine.global_samples, engine.micro_steps) == (1, 8, 0)
engine.eval_batch(iter(data))
assert not module.training  # left in eval mode on every stage, as DeepSpeed
# DeepSpeed's grid names: every group's ranks, this rank's, its process group
assert grid.dp_groups == [[0, 1], [2, 3]] and grid.dp_group == grid.dp_groups[stage]
assert grid.pipe_groups == [[0, 2], [1, 3]] and grid.pp_group == [replica, 2 + replica]
assert grid.slice_group == [rank]
for group, ranks in ((grid.dp_proc_group, grid.dp_group), (grid.pp_proc_group, grid.pp_group),
                     (grid.slice_proc_group, grid.slice_group)):
    value = torch.tensor([float(rank)])
    dist.all_reduce(value, group=group)
    assert float(value) == sum(ranks), (ranks, value)
# the module's DeepSpeed names
assert module.fwd_map == ({"1": 1} if stage == 0 else {"2": 0}), module.fwd_map
assert module.tied_weight_attrs == {key: ["weight"] for key in comms}
assert module.ckpt_prefix("/ck", "t") == f"/ck/t/module-pipe_{stage:02d}"
pairs = module.get_tied_weights_and_groups()
assert [(w is module.tied_modules[k].weight, g is comms[k]["group"])
        for (w, g), k in zip(pairs, sorted(comms))] == [(True, True)] * len(comms)
engine.zero_grad()
for param in module.tied_modules.parameters():
    param.grad = torch.full_like(param, float(rank))
module.allreduce_tied_weight_gradients()  # summed over the stages holding each module
assert all(float(p.grad.min()) == float(p.grad.max()) == 2 * replica + 2
           for p in module.tied_modules["embed"].parameters())
if stage == 1:  # held by this stage alone: nothing to sum
    assert all(float(p.grad.max()) == rank for p in module.tied_modules["head"].parameters())
# seed_layers: every stage reseeds with the layers' own indices, as DeepSpeed
seeds = []
seeded = PipelineModule([LayerSpec(nn.Linear, 4, 4) for _ in range(4)], num_stages=2,
                        seed_layers=True, seed_fn=seeds.append, partition_method="uniform")
with torch.no_grad():
    seeded(torch.zeros(2, 4))
first = 2 * stage
assert seeds == [1234 + first, 1235 + first, 2468 + first, 2469 + first], seeds
print(f"NAMES OK {rank}", flush=True)
'''


def test_deepspeeds_names_on_two_stages_and_two_replicas(tmp_path: Any) -> None:
    script = tmp_path / "names.py"
    script.write_text(TIED_JOB)
    res = run_dsrun("--cpu", "--num_gpus", "4", str(script), timeout=180, cwd=str(ROOT))
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    assert sorted(line.split("NAMES OK ")[1][:1] for line in res.stdout.splitlines()
                  if "NAMES OK " in line) == ["0", "1", "2", "3"], res.stdout[-3000:]
