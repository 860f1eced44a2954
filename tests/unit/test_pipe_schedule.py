"""Pipeline schedules (dsrun.runtime.pipe.schedule), checked by running all
stages' instruction streams together in a simulator: sends never block,
receives wait for the matching message of their channel (FIFO), forward
costs 1 time unit and backward 2, communication is free."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import pytest

from dsrun.runtime.pipe import schedule as sc

STAGES = range(1, 5)
MICRO_BATCHES = range(1, 9)
FWD, BWD = 1.0, 2.0
CHANNELS = {  # instruction -> (channel kind, direction: +1 to next stage, -1 to previous)
    sc.SendActivation: ("act", +1), sc.RecvActivation: ("act", -1),
    sc.SendGrad: ("grad", -1), sc.RecvGrad: ("grad", +1),
}


@dataclass
class Run:
    traces: list[list[sc.Instruction]] = field(default_factory=list)
    finish: list[float] = field(default_factory=list)
    max_in_flight: list[int] = field(default_factory=list)
    labels_seen: list[int] = field(default_factory=list)


def _channel(ins: sc.Instruction, stage: int, stages: int) -> tuple[str, int, int]:
    if isinstance(ins, (sc.SendLabels, sc.RecvLabels)):
        return ("labels", 0, stages - 1)
    kind, direction = CHANNELS[type(ins)]
    is_send = type(ins).__name__.startswith("Send")
    peer = stage + direction
    return (kind, stage, peer) if is_send else (kind, peer, stage)


def simulate(stages: int, micro_batches: int, make=sc.train_schedule) -> Run:
    programs = [make(stages, micro_batches, s) for s in range(stages)]
    queues: dict[tuple[str, int, int], collections.deque] = collections.defaultdict(
        collections.deque)
    pc, clock = [0] * stages, [0.0] * stages
    in_flight, run = [0] * stages, Run()
    run.traces = [[] for _ in range(stages)]
    run.max_in_flight = [0] * stages
    while any(pc[s] < len(programs[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while pc[s] < len(programs[s]):
                ins = programs[s][pc[s]]
                name = type(ins).__name__
                if name.startswith("Recv"):
                    queue = queues[_channel(ins, s, stages)]
                    if not queue:
                        break  # blocked
                    mb, sent_at = queue.popleft()
                    assert mb == ins.micro_batch, f"stage {s} {ins} got micro-batch {mb}"
                    clock[s] = max(clock[s], sent_at)
                    if isinstance(ins, sc.RecvLabels):
                        run.labels_seen.append(mb)
                elif name.startswith("Send"):
                    queues[_channel(ins, s, stages)].append((ins.micro_batch, clock[s]))
                elif isinstance(ins, sc.Forward):
                    clock[s] += FWD
                    in_flight[s] += make is sc.train_schedule
                    run.max_in_flight[s] = max(run.max_in_flight[s], in_flight[s])
                elif isinstance(ins, sc.Backward):
                    clock[s] += BWD
                    in_flight[s] -= 1
                run.traces[s].append(ins)
                pc[s] += 1
                progressed = True
        assert progressed, f"deadlock: stages wait at {[programs[s][pc[s]] for s in range(stages) if pc[s] < len(programs[s])]}"  # noqa: E501
    assert all(not q for q in queues.values()), "messages left unreceived"
    run.finish = clock
    return run


@pytest.mark.parametrize("stages", STAGES)
@pytest.mark.parametrize("micro_batches", MICRO_BATCHES)
def test_train_schedule_runs_every_micro_batch_once_in_order(stages: int,
                                                             micro_batches: int) -> None:
    run = simulate(stages, micro_batches)  # no deadlock, every receive paired
    for s, trace in enumerate(run.traces):
        forwards = [i.micro_batch for i in trace if isinstance(i, sc.Forward)]
        backwards = [i for i in trace if isinstance(i, sc.Backward)]
        assert forwards == list(range(micro_batches))
        assert [b.micro_batch for b in backwards] == list(range(micro_batches))
        assert [b.reduce_grads for b in backwards] == [False] * (micro_batches - 1) + [True]
        for k in range(micro_batches):
            assert trace.index(sc.Forward(k)) < trace.index(backwards[k])
        assert trace[-3:] == [sc.ReduceGrads(), sc.ReduceTiedGrads(), sc.OptimizerStep()]
        assert trace.index(sc.ReduceGrads()) > trace.index(backwards[-1])
        # at most `stages - s` activations kept: 1F1B, not GPipe
        assert run.max_in_flight[s] == min(stages - s, micro_batches)
        loads = [i.micro_batch for i in trace if isinstance(i, sc.LoadMicroBatch)]
        assert loads == (list(range(micro_batches)) if s == 0 else [])


@pytest.mark.parametrize("stages", STAGES)
@pytest.mark.parametrize("micro_batches", MICRO_BATCHES)
def test_train_schedule_takes_the_1f1b_time(stages: int, micro_batches: int) -> None:
    """(M + S - 1) x (forward + backward): busy M of those slots per stage."""
    run = simulate(stages, micro_batches)
    assert max(run.finish) == (micro_batches + stages - 1) * (FWD + BWD)


@pytest.mark.parametrize("stages", STAGES)
@pytest.mark.parametrize("micro_batches", MICRO_BATCHES)
def test_labels_reach_the_last_stage_with_their_micro_batch(stages: int,
                                                            micro_batches: int) -> None:
    run = simulate(stages, micro_batches)
    if stages == 1:
        assert not any(isinstance(i, (sc.SendLabels, sc.RecvLabels)) for i in run.traces[0])
        return
    assert run.labels_seen == list(range(micro_batches))  # the simulator checked pairing
    last = run.traces[-1]
    for k in range(micro_batches):
        assert last.index(sc.RecvLabels(k)) + 1 == last.index(sc.Forward(k))
    first = run.traces[0]
    for k in range(micro_batches):
        assert first.index(sc.LoadMicroBatch(k)) + 1 == first.index(sc.SendLabels(k))


@pytest.mark.parametrize("stages", STAGES)
@pytest.mark.parametrize("micro_batches", MICRO_BATCHES)
def test_inference_schedule_streams_forwards(stages: int, micro_batches: int) -> None:
    run = simulate(stages, micro_batches, sc.inference_schedule)
    for trace in run.traces:
        assert [i.micro_batch for i in trace if isinstance(i, sc.Forward)] == \
            list(range(micro_batches))
        assert not any(isinstance(i, (sc.Backward, sc.OptimizerStep)) for i in trace)
    assert max(run.finish) == (micro_batches + stages - 1) * FWD


def test_without_labels_none_are_sent() -> None:
    for s in range(3):
        program = sc.train_schedule(3, 4, s, labels=False)
        assert not any(isinstance(i, (sc.SendLabels, sc.RecvLabels)) for i in program)


def test_two_stages_two_micro_batches_exactly() -> None:
    assert [str(i) for i in sc.train_schedule(2, 2, 1)] == [
        "RecvActivation(0)", "RecvLabels(0)", "Forward(0)", "Backward(0, False)",
        "SendGrad(0)", "RecvActivation(1)", "RecvLabels(1)",
        "Forward(1)", "Backward(1, True)", "SendGrad(1)", "ReduceGrads()",
        "ReduceTiedGrads()", "OptimizerStep()"]
    assert [str(i) for i in sc.train_schedule(2, 2, 0)] == [
        "LoadMicroBatch(0)", "SendLabels(0)", "Forward(0)", "SendActivation(0)",
        "LoadMicroBatch(1)", "SendLabels(1)", "Forward(1)", "SendActivation(1)",
        "RecvGrad(0)", "Backward(0, False)", "RecvGrad(1)", "Backward(1, True)",
        "ReduceGrads()", "ReduceTiedGrads()", "OptimizerStep()"]


@pytest.mark.parametrize("args", [(0, 1, 0), (2, 0, 0), (2, 1, 2), (2, 1, -1), (True, 1, 0)])
def test_bad_arguments(args: tuple) -> None:
    with pytest.raises(ValueError):
        sc.train_schedule(*args)


# ------------------------------------------------ DeepSpeed's schedule classes


@pytest.mark.parametrize("stages", STAGES)
@pytest.mark.parametrize("micro_batches", MICRO_BATCHES)
def test_train_schedule_class_gives_the_program_in_steps(stages: int,
                                                         micro_batches: int) -> None:
    run = simulate(stages, micro_batches)
    for s in range(stages):
        schedule = sc.TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=s)
        steps = list(schedule)
        assert [i for step in steps for i in step] == run.traces[s]  # what the stage runs
        assert list(schedule) == steps  # iterable again, as DeepSpeed's
        # one pass per step, its sends after it; the batch's end in the last step
        assert len(steps) == 2 * micro_batches
        for step in steps:
            passes = [i for i in step if isinstance(i, (sc.ForwardPass, sc.BackwardPass))]
            assert len(passes) == 1
            after = step[step.index(passes[0]) + 1:]
            assert all(isinstance(i, (sc.SendActivation, sc.SendGrad)) for i in after
                       if i not in (sc.ReduceGrads(), sc.ReduceTiedGrads(), sc.OptimizerStep()))
        assert steps[-1][-3:] == [sc.ReduceGrads(), sc.ReduceTiedGrads(), sc.OptimizerStep()]
        assert schedule.num_pipe_buffers() == run.max_in_flight[s]
        assert (schedule.stage, schedule.num_stages, schedule.num_micro_batches) == \
            (s, stages, micro_batches)
        assert (schedule.is_first_stage, schedule.is_last_stage) == (s == 0, s == stages - 1)
        assert (schedule.prev_stage, schedule.next_stage) == (s - 1, s + 1)


def test_inference_schedule_class_and_instruction_names() -> None:
    for s in range(3):
        steps = list(sc.InferenceSchedule(4, 3, s))
        assert [i for step in steps for i in step] == list(sc.inference_schedule(3, 4, s))
        assert [[type(i) for i in step if isinstance(i, sc.ForwardPass)] for step in steps] \
            == [[sc.Forward]] * 4
        assert sc.InferenceSchedule(4, 3, s).num_pipe_buffers() == 1
    assert sc.ForwardPass is sc.Forward and sc.BackwardPass is sc.Backward
    assert isinstance(sc.OptimizerStep(), sc.PipeInstruction)
    assert isinstance(sc.TrainSchedule(1, 1, 0), sc.PipeSchedule)
    backward = sc.BackwardPass(3, reduce_grads=True)
    assert (backward.name, backward.kwargs) == ("Backward", {"micro_batch": 3,
                                                             "reduce_grads": True})
    assert (sc.ReduceGrads().name, sc.ReduceGrads().kwargs) == ("ReduceGrads", {})
    with pytest.raises(ValueError, match="stage must be in"):
        sc.TrainSchedule(4, 2, 2)

    class Custom(sc.PipeSchedule):
        def steps(self):  # type: ignore[no-untyped-def]
            yield [sc.LoadMicroBatch(0), sc.ForwardPass(0)]

    assert list(Custom(2, 1, 0)) == [[sc.LoadMicroBatch(0), sc.Forward(0)]]
    assert Custom(2, 1, 0).num_pipe_buffers() == 2  # DeepSpeed's default: micro_batches
