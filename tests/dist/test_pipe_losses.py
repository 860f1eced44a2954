"""What a pipeline engine reports besides training: DeepSpeed's additional
losses (``engine.get_additional_losses()``), ``eval_batch``'s reduction
names, and the error for a stage that owns nothing to train. One process
(world size 1) where that shows it, 2-rank jobs where only real stages do;
the 2 x 2 averaging of additional losses is in test_pipe_parity.py
(``mlp-aux``)."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn as nn

import dsrun
from dsrun.errors import DsrunConfigError, DsrunError
from dsrun.pipe import LayerSpec, PipelineEngine, PipelineModule
from tests.conftest import ROOT, run_dsrun
from tests.dist.pipe_support import load_cases

pytestmark = pytest.mark.dist
cases = load_cases()


class Scripted(PipelineModule):
    """Answers DeepSpeed's ``get_additional_losses()`` hook from a script."""

    def __init__(self, answers: Iterator[Any], **kwargs: Any) -> None:
        super().__init__(cases.mlp_layers(), num_stages=1, loss_fn=nn.functional.cross_entropy,
                         **kwargs)
        self.answers = answers

    def get_additional_losses(self) -> Any:
        return next(self.answers)


def _scripted(answers: list[Any]) -> PipelineEngine:
    engine, _, _, _ = dsrun.initialize(model=Scripted(iter(answers)),
                                       config=cases.CASES["mlp"].config())
    assert isinstance(engine, PipelineEngine)
    return engine


def test_additional_losses_are_the_batch_mean_as_deepspeed(solo: None) -> None:
    """Summed name by name over the micro-batches (a name first seen later
    starts there), divided by their number: DeepSpeed's arithmetic."""
    t = torch.tensor
    answers = [OrderedDict(a=t(1.0), b=t(2.0)), {"a": t(3.0)},
               {"a": 5, "b": t([4.0], dtype=torch.float64)}, {"a": t(7.0)},
               None, None, None, None]
    engine = _scripted(answers)
    case = cases.CASES["mlp"]
    assert engine.get_additional_losses() is None  # before any batch, as DeepSpeed
    engine.train_batch(iter(case.batch(0, 0)))
    got = engine.get_additional_losses()
    assert got is engine.agg_additional_losses and isinstance(got, OrderedDict)
    assert list(got) == ["a", "b"]
    assert (float(got["a"]), float(got["b"])) == (4.0, 1.5)
    assert all(v.dtype == torch.float32 and v.shape == () for v in got.values())
    engine.eval_batch(iter(case.eval_data()))  # evaluation leaves them alone
    assert engine.get_additional_losses() is got
    engine.train_batch(iter(case.batch(1, 0)))  # the hook answers None again
    assert engine.get_additional_losses() is None


def test_the_progress_line_shows_additional_losses(solo: None,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """As DeepSpeed's pipeline prints ``name: value`` after the loss, the
    progress line gives each additional loss's mean after ``loss=``."""
    import logging

    from dsrun.runtime.progress import LOGGER_NAME

    t = torch.tensor
    answers = [{"aux": t(1.0)}, {"aux": t(3.0)}] * 8
    config = dict(cases.CASES["mlp"].config(), steps_per_print=2)
    engine, _, _, _ = dsrun.initialize(model=Scripted(iter(answers)), config=config)
    case = cases.CASES["mlp"]
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        for batch in range(2):
            engine.train_batch(iter(case.batch(batch, 0)))
    lines = [r.getMessage() for r in caplog.records if "step=2" in r.getMessage()]
    assert len(lines) == 1 and ", aux=2.0000, lr=" in lines[0], lines
    assert lines[0].index("loss=") < lines[0].index("aux=")


@pytest.mark.parametrize("answer, message", [
    ({"aux": torch.ones(2)}, "get_additional_losses()['aux'] is a tensor of shape [2]"),
    ({"aux": "high"}, "get_additional_losses()['aux'] is a str"),
    ([torch.ones(())], "get_additional_losses() returned a list"),
])
def test_a_bad_additional_loss_names_the_key(solo: None, answer: Any, message: str) -> None:
    engine = _scripted([answer] * 4)
    with pytest.raises(DsrunError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")) as info:
        engine.train_batch(iter(cases.CASES["mlp"].batch(0, 0)))
    assert "pipeline stage 0 (layers 0-5), micro-batch 0" in str(info.value)


def test_a_plain_module_has_no_additional_losses(solo: None) -> None:
    case = cases.CASES["mlp"]
    engine, _, _, _ = dsrun.initialize(model=cases.build("mlp", 1), config=case.config())
    engine.train_batch(iter(case.batch(0, 0)))
    assert engine.get_additional_losses() is None and engine.agg_additional_losses is None


def test_eval_batch_reduce_output_in_any_case(solo: None) -> None:
    """DeepSpeed compares ``reduce_output.lower() == "avg"``."""
    case = cases.CASES["mlp"]
    engine, _, _, _ = dsrun.initialize(model=cases.build("mlp", 1), config=case.config())
    avg = engine.eval_batch(iter(case.eval_data()))
    for name in ("AVG", "Avg"):
        assert torch.equal(engine.eval_batch(iter(case.eval_data()), reduce_output=name), avg)
    with pytest.raises(NotImplementedError, match="reduce_output='SUM'"):
        engine.eval_batch(iter(case.eval_data()), reduce_output="SUM")


def test_a_module_without_parameters(solo: None) -> None:
    config = cases.CASES["mlp"].config()
    module = PipelineModule([nn.ReLU(), nn.Tanh()], num_stages=1)
    with pytest.raises(ValueError, match="the PipelineModule has no parameters") as info:
        dsrun.initialize(model=module, config=config)
    assert isinstance(info.value, DsrunConfigError)
    # frozen parameters go into the optimizer (they train once unfrozen): no error
    frozen = PipelineModule([LayerSpec(nn.Linear, 4, 4)], num_stages=1)
    frozen.requires_grad_(False)
    dsrun.initialize(model=frozen, config=config)
    # without an optimizer to build there is nothing to refuse (inference)
    engine, optimizer, _, _ = dsrun.initialize(model=module, config={
        "train_micro_batch_size_per_gpu": 4})
    assert optimizer is None
    assert torch.equal(engine(torch.tensor([-1.0, 2.0])), torch.tanh(torch.tensor([0.0, 2.0])))


# ------------------------------------------------------------------- 2-rank jobs

NO_PARAMETERS = '''
import torch, torch.nn as nn
import dsrun
from dsrun.pipe import LayerSpec, PipelineModule

dsrun.init_distributed()
module = PipelineModule([LayerSpec(nn.Linear, 4, 2), nn.ReLU()], num_stages=2,
                        loss_fn=nn.functional.cross_entropy)
dsrun.initialize(model=module, config={"train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
'''


def test_a_stage_without_parameters_is_one_error_at_initialize(tmp_path: Any) -> None:
    """Stage 1 holds only a ReLU: both ranks raise the same error, naming the
    stage and the partition (not the optimizer's rejection of an empty list)."""
    script = tmp_path / "no_parameters.py"
    script.write_text(NO_PARAMETERS)
    res = run_dsrun("--cpu", "--num_gpus", "2", str(script), timeout=120, cwd=str(ROOT))
    out = res.stdout + res.stderr
    assert res.returncode != 0
    assert "PipeValueError: pipeline stage 1 (layers 1-1: ReLU) owns no parameters" in out, \
        out[-3000:]
    assert "partition_method='parameters' cut 2 layers into 2 stages at [0, 1, 2]" in out
    assert "a smaller num_stages" in out and "rejected params" not in out
    assert "1 other rank(s) failed with the same error" in out, out[-3000:]


CHANGING_NAMES = '''
import json, sys
import torch, torch.nn as nn
import torch.distributed as dist
import dsrun
from dsrun.pipe import LayerSpec, PipelineModule

# the last stage's answers, two micro-batches per batch; the first stage's
# hook answers None (DeepSpeed takes the names from every stage's own hook)
SCRIPT = [None, None, {"x": 1.0}, {"x": 3.0}, {"x": 2.0, "y": 4.0}, {"x": 4.0, "y": 6.0},
          {"x": 0.0, "y": 1.0}, {"y": 3.0, "x": 0.0}, None, None]

class Scripted(PipelineModule):
    calls = 0
    def get_additional_losses(self):
        if self.stage_id == 0:
            return None
        self.calls += 1
        answer = SCRIPT[self.calls - 1]
        return None if answer is None else {k: torch.tensor(v) for k, v in answer.items()}

dsrun.init_distributed()
module = Scripted([LayerSpec(nn.Linear, 4, 4), LayerSpec(nn.Linear, 4, 2)], num_stages=2,
                  loss_fn=nn.functional.cross_entropy)
engine, _, _, _ = dsrun.initialize(model=module, config={"train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
torch.manual_seed(0)
data = [(torch.randn(2, 4), torch.tensor([0, 1])) for _ in range(2)]
seen = []
for _ in range(5):
    loss = engine.train_batch(iter(data))
    extra = engine.get_additional_losses()
    seen.append([float(loss), None if extra is None else {k: float(v) for k, v in extra.items()}])
with open(sys.argv[1] + f"/rank{dist.get_rank()}.json", "w") as f:
    json.dump(seen, f)
'''


def test_additional_losses_reach_every_stage_as_their_names_change(tmp_path: Any) -> None:
    """The stages agree on the last stage's names when they change (None ->
    x -> x, y -> None) and get the same values every batch."""
    script = tmp_path / "changing.py"
    script.write_text(CHANGING_NAMES)
    res = run_dsrun("--cpu", "--num_gpus", "2", str(script), str(tmp_path), timeout=120,
                    cwd=str(ROOT))
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]
    assert [extra for _, extra in ranks[0]] == [
        None, {"x": 2.0}, {"x": 3.0, "y": 5.0}, {"x": 0.0, "y": 2.0}, None]
