"""Checkpoint save and load: dsrun (sync, async) vs DeepSpeed vs torch DCP.

    .venv/bin/python bench/checkpoint.py [--rounds 3] [--model large]
        [--runners dsrun-sync,dsrun-async,deepspeed,dcp-fsdp2] [--dir DIR] [--json OUT]

The GPT-like model of ``bench/train_throughput.py`` (``--model large``: ~160M
parameters; ``small``: 23M), fp32 AdamW, 2 CPU ranks with gloo started by
``dsrun --num_gpus 2``, ZeRO stage 3 (or its torch equivalent, FSDP2
``fully_shard`` per block). Each run trains one step (so the optimizer has
its state), then, between barriers:

* **save** - ``engine.save_checkpoint`` (dsrun, DeepSpeed 0.19.8) or
  ``dcp.save`` of ``get_state_dict(model, optimizer)`` (torch DCP,
  ``FileSystemWriter`` defaults: fsync on, one file per rank). For
  ``dsrun-async`` (``"checkpoint": {"async": true}``) two times: how long
  ``save_checkpoint`` blocks the training loop, and until the checkpoint is
  committed, with one training step run while it writes; the loop is
  *blocked* for the call plus the time that step's optimizer update waited
  for the background copy of the state (the step is also reported whole: on
  CPU ranks the writing thread shares the cores). *Committed after* is the
  time from rank 0's ``save_checkpoint`` call until its background save
  finished (``AsyncSaver.finished_at``, taken in the save thread): the
  commit is rank 0's rename, so that is when the tag was committed. It does
  not wait for the step that runs meanwhile (``wait_for_checkpoint`` is
  called only after it). The other ranks' threads end only once they have
  read rank 0's verdict from the store, which they poll with a backoff of up
  to 1 s; the slowest rank's time is shown beside it;
* ``dsrun-nofsync`` (``"checkpoint": {"fsync": false}``) skips fsync, as
  DeepSpeed's ``torch.save`` and a DCP writer with ``sync_files=False`` do:
  the like-for-like comparison with DeepSpeed;
* **load** - into the same engine/model (``load_checkpoint`` / ``dcp.load``
  + ``set_state_dict``); the files are in the page cache (just written).

Reported: medians over interleaved rounds of the slowest rank's times, and
each rank's peak RSS (VmHWM) and how much the save raised it. DeepSpeed's
peak includes building the whole model on every rank (it runs without
``zero.Init``), the dsrun runners build it partitioned.

Each run also checks that the load restored what was saved: after the save
it trains two more steps (the async runner's first is the one that
overlaps the save), loads, and trains the same two steps again; their
losses must equal the first two's (bench/losscheck.py, relative tolerance
1e-4: the first checks the weights, the second the optimizer state). The
losses of every step are also compared across runners (all start from the
same weights and data). A mismatch is printed and the bench exits non-zero
naming the runners. All runners
write the same state (fp32 master shards + two Adam moments, ~12 bytes per
parameter in all) into a fresh directory under ``--dir`` (default: a
temporary directory on the same file system as /tmp), deleted after.

DeepSpeed runs where ``bench/.venv-ds`` imports it (see
``bench/train_throughput.py``'s docstring for how it is set up).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import losscheck  # noqa: E402 - the runners' losses compared
import train_throughput as tt  # noqa: E402 - the bench model and its DeepSpeed venv

MiB = 2**20


def hwm_mib() -> float:
    """This process image's peak resident set (VmHWM), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


# ------------------------------------------------------------- rank side


class Subject:
    """What a runner gives the timing loop."""

    def __init__(self, step: Callable[[Any], Any], save: Callable[[str], None],
                 load: Callable[[str], None], wait: Callable[[], None] = lambda: None) -> None:
        self.step, self.save, self.load, self.wait = step, save, load, wait
        self.stage_wait: Callable[[], float] = lambda: 0.0
        # perf_counter when the last async save finished (None: not finished)
        self.save_finished: Callable[[], Optional[float]] = lambda: None


def dsrun_subject(engine: Any) -> Subject:
    """A dsrun engine's :class:`Subject`; its async saver is read through the
    checkpoint module's public accessor (the engine makes it on first use)."""
    from dsrun.runtime.checkpoint.engine_io import checkpointer

    subject = Subject(tt._engine_step(engine), lambda d: engine.save_checkpoint(d, tag="b"),
                      lambda d: engine.load_checkpoint(d, tag="b"), engine.wait_for_checkpoint)
    subject.stage_wait = lambda: checkpointer(engine).saver.stage_wait_s
    subject.save_finished = lambda: checkpointer(engine).saver.finished_at
    return subject


def _dsrun(async_save: bool, fsync: bool = True) -> Callable[[], Subject]:
    def setup() -> Subject:
        import dsrun
        import dsrun.zero

        config = {**tt._ds_config(3), "checkpoint": {"async": async_save, "fsync": fsync}}
        with dsrun.zero.Init(config_dict_or_path=config):
            model = tt.build_model()
        dsrun.zero.register_external_parameter(model, model.wpe.weight)
        engine, *_ = dsrun.initialize(model=model, config=config)
        return dsrun_subject(engine)
    return setup


def _deepspeed() -> Subject:
    import deepspeed

    model = tt.build_model()
    engine, *_ = deepspeed.initialize(model=model, config=tt._ds_config(3),
                                      model_parameters=model.parameters())
    return Subject(tt._engine_step(engine), lambda d: engine.save_checkpoint(d, tag="b"),
                   lambda d: engine.load_checkpoint(d, tag="b"))


def _dcp_fsdp2() -> Subject:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    model = tt.build_model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=tt.LR, weight_decay=0.0)

    def save(path: str) -> None:
        model_sd, optim_sd = get_state_dict(model, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)

    def load(path: str) -> None:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])

    return Subject(tt._plain_step(model, opt), save, load)


RUNNERS: dict[str, Callable[[], Subject]] = {
    "dsrun-sync": _dsrun(False), "dsrun-async": _dsrun(True),
    "dsrun-nofsync": _dsrun(False, fsync=False), "deepspeed": _deepspeed,
    "dcp-fsdp2": _dcp_fsdp2,
}


def _timed(fn: Callable[[], Any]) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    dist.barrier()
    return elapsed


def _async_save(subject: Subject, directory: str, step: Callable[[], float],
                facts: dict[str, Any]) -> None:
    """The async save with one step overlapping it (module docstring)."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    subject.save(directory)
    facts["save_s"] = time.perf_counter() - start
    dist.barrier()
    start_step = time.perf_counter()
    facts["after_save_losses"] = [step()]  # overlaps the background save
    facts["step_during_save_s"] = time.perf_counter() - start_step
    facts["stage_wait_s"] = subject.stage_wait()
    _timed(subject.wait)
    finished = subject.save_finished()
    if finished is None:
        raise RuntimeError("the async save was waited for but its saver has no finished_at")
    facts["complete_s"] = finished - start


def worker(runner: str, directory: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    import dsrun

    dsrun.init_distributed()
    rank = dist.get_rank()
    subject = RUNNERS[runner]()
    tokens = torch.randint(0, tt.VOCAB, (tt.BATCH, tt.SEQ + 1),
                           generator=torch.Generator().manual_seed(rank))
    losses: list[float] = []

    def step() -> float:
        losses.append(float(subject.step(tokens)))
        return losses[-1]

    step()
    step_s = _timed(step)  # a step with no save in flight
    before = hwm_mib()
    facts: dict[str, Any] = {"rank": rank, "step_s": step_s}
    if runner == "dsrun-async":
        _async_save(subject, directory, step, facts)
    else:
        facts["save_s"] = _timed(lambda: subject.save(directory))
        facts["after_save_losses"] = []
    facts["save_hwm_growth_mib"] = hwm_mib() - before
    while len(facts["after_save_losses"]) < 2:  # the state moves on from the saved one
        facts["after_save_losses"].append(step())
    facts["load_s"] = _timed(lambda: subject.load(directory))
    facts["peak_rss_mib"] = hwm_mib()
    facts["after_load_losses"] = [step(), step()]  # must repeat the two after the save
    facts["losses"] = losses
    Path(out, f"rank{rank}.json").write_text(json.dumps(facts))


# ------------------------------------------------------------ driver side


def run_once(python: str, runner: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as out, \
            tempfile.TemporaryDirectory(dir=args.dir) as ckpt:
        argv = [python, "-m", "dsrun.launcher.cli", "--num_gpus", "2", __file__, "--worker",
                runner, "--ckpt", ckpt, "--out", out, "--model", args.model]
        env = {**os.environ, "DS_ACCELERATOR": "cpu"}
        res = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=str(ROOT))
        if res.returncode != 0:
            raise SystemExit(f"{runner} failed ({res.returncode}):\n{res.stderr[-3000:]}")
        size = sum(f.stat().st_size for f in Path(ckpt).rglob("*") if f.is_file())
        facts = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
        for fact in facts:
            fact["bytes"] = size
        shutil.rmtree(ckpt, ignore_errors=True)
        return facts


def med_sum(rounds: list[list[dict[str, Any]]], *keys: str) -> float:
    """Median over rounds of the slowest rank's sum of ``keys``."""
    return statistics.median(max(sum(r[k] for k in keys) for r in ranks) for ranks in rounds)


def summarise(runs: dict[str, list[list[dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    table = {}
    for name, rounds in runs.items():
        def med(key: str, rounds: list[list[dict[str, Any]]] = rounds) -> float:
            return statistics.median(max(r[key] for r in ranks) for ranks in rounds)

        row = {"save_s": med("save_s"), "load_s": med("load_s"),
               "peak_rss_mib": [max(ranks[i]["peak_rss_mib"] for ranks in rounds)
                                for i in range(len(rounds[0]))],
               "save_growth_mib": [max(ranks[i]["save_hwm_growth_mib"] for ranks in rounds)
                                   for i in range(len(rounds[0]))],
               "bytes": rounds[0][0]["bytes"], "rounds": len(rounds)}
        row["step_s"] = med("step_s")
        if "complete_s" in rounds[0][0]:
            # rank 0 commits (module docstring); the others also wait to read its verdict
            row["complete_s"] = statistics.median(
                next(r["complete_s"] for r in ranks if r["rank"] == 0) for ranks in rounds)
            row["complete_slowest_s"] = med("complete_s")
            row["step_during_save_s"] = med("step_during_save_s")
            row["stage_wait_s"] = med("stage_wait_s")
            row["blocked_s"] = med_sum(rounds, "save_s", "stage_wait_s")
        table[name] = row
    return table


def print_table(table: dict[str, dict[str, Any]], missing: list[str], args: Any) -> None:
    print(f"model {args.model}, ZeRO stage 3 / FSDP2, 2 CPU ranks (gloo), "
          f"{args.rounds} interleaved round(s); seconds are the slowest rank's, medians")
    print(f"{'runner':<13}{'save s':>8}{'load s':>8}{'on disk MiB':>13}"
          f"{'peak RSS MiB/rank':>20}{'save raised peak by':>21}")
    for name, row in table.items():
        rss = " / ".join(f"{round(m):d}" for m in row["peak_rss_mib"])
        grow = " / ".join(f"{round(m):d}" for m in row["save_growth_mib"])
        print(f"{name:<13}{row['save_s']:>8.2f}{row['load_s']:>8.2f}{row['bytes'] / MiB:>13.0f}"
              f"{rss:>20}{grow:>21}")
    for name in missing:
        print(f"{name:<13}  DeepSpeed not installed (see bench/train_throughput.py)")
    if "deepspeed" in table:
        print("(DeepSpeed's peak RSS includes building the whole model on every rank: it "
              "runs without zero.Init)")
    sync, done = table.get("dsrun-sync"), table.get("dsrun-async")
    if done:
        print(f"dsrun-async: training blocked {done['blocked_s']:.2f} s (save_checkpoint "
              f"returned after {done['save_s']:.2f} s; the next step waited "
              f"{done['stage_wait_s']:.2f} s for the background copy); committed after "
              f"{done['complete_s']:.2f} s (rank 0, from the call until its save thread "
              f"ended; slowest rank {done['complete_slowest_s']:.2f} s, its thread waits to "
              "read rank 0's verdict); the step that ran meanwhile took "
              f"{done['step_during_save_s']:.2f} s, {done['step_s']:.2f} s without a save")
    if sync and done:
        print(f"async blocked / sync save = {done['blocked_s'] / sync['save_s']:.3f} "
              "(goal <= 0.2)")
    for mine in ("dsrun-sync", "dsrun-nofsync"):
        for anchor, goal in (("dcp-fsdp2", 1.0), ("deepspeed", 0.7)):
            if mine in table and anchor in table:
                for key in ("save_s", "load_s"):
                    ratio = table[mine][key] / table[anchor][key]
                    note = f" (goal <= {goal})" if key == "save_s" and mine == "dsrun-sync" \
                        else ""
                    print(f"{mine} / {anchor} {key[:-2]} = {ratio:.3f}{note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runners", default=",".join(RUNNERS))
    parser.add_argument("--model", choices=sorted(tt.MODELS), default="large")
    parser.add_argument("--dir", default=None, help="where the checkpoints are written")
    parser.add_argument("--ds-python", default=str(tt.DS_PYTHON))
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    tt.use_model(args.model)
    if args.worker:
        worker(args.worker, args.ckpt, args.out)
        return
    names = [n for n in args.runners.split(",") if n]
    unknown = [n for n in names if n not in RUNNERS]
    if unknown:
        raise SystemExit(f"unknown runner(s) {unknown}; choose from {list(RUNNERS)}")
    ds_python = tt.deepspeed_python(Path(args.ds_python))
    missing = [n for n in names if n == "deepspeed" and ds_python is None]
    names = [n for n in names if n not in missing]
    runs: dict[str, list[list[dict[str, Any]]]] = {n: [] for n in names}
    for i in range(args.rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            python = ds_python if name == "deepspeed" else sys.executable
            runs[name].append(run_once(python or sys.executable, name, args))
            print(f"round {i + 1} {name}: save {runs[name][-1][0]['save_s']:.2f}s",
                  file=sys.stderr, flush=True)
    table = summarise(runs)
    print_table(table, missing, args)
    found = check_losses(runs)
    if args.json:
        Path(args.json).write_text(json.dumps({"table": table, "missing": missing,
                                               "loss_mismatches": found}, indent=1))
    losscheck.exit_on(found)


def check_losses(runs: dict[str, list[list[dict[str, Any]]]]) -> list[str]:
    """Every run's two steps after the load against its two after the save,
    then every run's losses across runners (module docstring)."""
    found = []
    for name, rounds in runs.items():
        for i, ranks in enumerate(rounds):
            for fact in ranks:
                found += losscheck.mismatches({
                    f"{name} round {i + 1} rank {fact['rank']} after the save":
                        fact["after_save_losses"],
                    "after the load": fact["after_load_losses"]})
    print(f"load restored the saved state: {'MISMATCH' if found else 'yes'} (the two steps "
          "after the load repeat the two after the save, every run and rank)")
    for line in found:
        print(f"  {line}")
    return found + losscheck.check(
        {f"{name} round {i + 1}": [v for fact in ranks for v in fact["losses"]]
         for name, rounds in runs.items() for i, ranks in enumerate(rounds)},
        "losses across runners (every rank, every step)")


if __name__ == "__main__":
    main()
