"""Event names and the CSV layout of DeepSpeed's monitors (pure, no torch).

An event is ``(name, value, step)``; the engine's events use DeepSpeed's
names and, as DeepSpeed does, ``global_samples`` as their step, so existing
dashboards and CSV readers keep working. Names DeepSpeed does not write
(gradient norm, throughput, the extra breakdown parts) follow its pattern.

CSV layout (DeepSpeed's ``csvMonitor``): one file per event in
``output_path/job_name``, named after the event with ``/`` and spaces
replaced by ``_`` (``Train_Samples_train_loss.csv``); its first row is
``step,<last part of the name>`` and every event adds ``step,value``.
Unlike DeepSpeed, a file that already has rows (a resumed run writing
into the same directory) does not get the header a second time.

``RUN_INFO`` (``dsrun_run.json``) beside the CSV files records what a
reader needs to turn samples back into optimizer steps.
"""

from __future__ import annotations

from typing import Union

Event = tuple[str, float, int]
Number = Union[int, float]

PREFIX = "Train/Samples/"
TRAIN_LOSS = PREFIX + "train_loss"
EVAL_LOSS = PREFIX + "eval_loss"  # a pipeline's eval_batch, as DeepSpeed's
LR = PREFIX + "lr"
LOSS_SCALE = PREFIX + "loss_scale"
GRAD_NORM = PREFIX + "grad_norm"
SAMPLES_PER_SEC = PREFIX + "samples_per_sec"
TOKENS_PER_SEC = PREFIX + "tokens_per_sec"
TIME_PREFIX = PREFIX + "elapsed_time_ms_"

# DeepSpeed's wall_clock_breakdown parts (ms per optimizer step):
# backward = backward_inner + backward_allreduce (the wait for gradients'
# communication inside backward).
DEEPSPEED_PARTS = ("forward", "backward", "backward_inner", "backward_allreduce", "step")
# dsrun's additions: the wall time between optimizer steps, the time spent
# waiting for gradient reductions / ZeRO parameter gathers overall, and the
# monitor's own work (inside "step").
EXTRA_PARTS = ("iteration", "comm_reduce", "comm_gather", "monitor")
BREAKDOWN_PARTS = DEEPSPEED_PARTS + EXTRA_PARTS
# A pipeline's own parts (``batch_input`` and the receive waits after
# DeepSpeed's pipeline timers): reading micro-batches, waiting for
# activations (and labels) and for gradients from the neighbouring stages,
# posting sends and waiting for them, summing tied gradients across stages.
# Its ``backward_allreduce`` is the wait for the data-parallel reduction.
PIPELINE_ONLY_PARTS = ("batch_input", "pipe_recv_input", "pipe_recv_grad", "pipe_send",
                       "tied_reduce")
PIPELINE_PARTS = BREAKDOWN_PARTS + PIPELINE_ONLY_PARTS

RUN_INFO = "dsrun_run.json"
CSV_SUFFIX = ".csv"


def lr_event(group: int) -> str:
    """``Train/Samples/lr`` for param group 0 (DeepSpeed's), ``..._group<i>`` after."""
    return LR if group == 0 else f"{LR}_group{group}"


def time_event(part: str) -> str:
    if part not in PIPELINE_PARTS:
        raise ValueError(f"unknown breakdown part {part!r}; known: {', '.join(PIPELINE_PARTS)}")
    return TIME_PREFIX + part


def csv_filename(name: str) -> str:
    """The file an event's rows go to (DeepSpeed's sanitising)."""
    return name.replace("/", "_").replace(" ", "_") + CSV_SUFFIX


def csv_header(name: str) -> str:
    """The value column's header: the name's last ``/`` part."""
    return name.rsplit("/", 1)[-1]
