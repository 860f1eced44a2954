"""Which collectives a ZeRO stage 1/2 optimizer should use on this backend.

ZeRO needs two data movements per step over a flat buffer of S bytes split
into N equal shards:

* **reduce-scatter** (gradients): every rank ends with the mean of its own
  shard. Candidates: ``all_reduce`` of the whole buffer then keep a slice;
  ``reduce_scatter_single`` (tensor form, called ``reduce_scatter_tensor``
  before torch 2.13); the list-form ``reduce_scatter``; one ``reduce`` to
  each owner (DeepSpeed's stage-2 way).
* **all-gather** (updated parameters): every rank ends with all shards.
  Candidates: ``all_gather_single`` (``all_gather_into_tensor`` before);
  list-form ``all_gather``; one ``broadcast`` from each owner; ``all_reduce``
  of a zero buffer holding only this rank's shard.

Every candidate is timed on the same S (fp32; 1, 10 and 100 MB by default)
and reported as S / median time in GB/s, so numbers compare across rows.
Rank processes use one intra-op thread each (``OMP_NUM_THREADS=1``), as
dsrun's launcher sets it on a machine with as many cores as ranks.

Usage: ``python bench/collectives.py [--world 2] [--sizes-mb 1 10 100]
[--repeat 7] [--backend gloo|nccl]``. Ranks are started with
``torch.multiprocessing`` on a free local port; only rank 0 prints. With
``nccl`` rank ``r`` uses ``cuda:r`` (one GPU per rank: ``--world`` at most
the number of GPUs, else the bench refuses), its buffers live there and
every timing synchronises the device; ``gloo`` runs on CPU tensors.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

Op = Callable[[], None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ops(numel: int, rank: int, world: int, device: torch.device) -> dict[str, Op]:
    """The candidates for one buffer of ``numel`` fp32 elements on ``device``."""
    shard = numel // world
    full = torch.randn(shard * world, device=device)
    out_full = torch.empty_like(full)
    mine = torch.randn(shard, device=device)
    out_shard = torch.empty(shard, device=device)
    chunks = list(full.chunk(world))
    out_chunks = list(out_full.chunk(world))
    scratch = torch.zeros_like(full)
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def all_reduce_slice() -> None:
        dist.all_reduce(full)
        out_shard.copy_(full[rank * shard:(rank + 1) * shard])

    def reduce_to_owners() -> None:
        works = [dist.reduce(chunks[r], dst=r, async_op=True) for r in range(world)]
        for work in works:
            work.wait()

    def broadcast_gather() -> None:
        out_chunks[rank].copy_(mine)
        works = [dist.broadcast(out_chunks[r], src=r, async_op=True) for r in range(world)]
        for work in works:
            work.wait()

    def all_reduce_gather() -> None:
        scratch.zero_()
        scratch[rank * shard:(rank + 1) * shard].copy_(mine)
        dist.all_reduce(scratch)

    return {
        "reduce: all_reduce + slice": all_reduce_slice,
        "reduce: reduce_scatter_single (tensor)": lambda: scatter_single(out_shard, full),
        "reduce: reduce_scatter (list)": lambda: dist.reduce_scatter(out_shard, chunks),
        "reduce: reduce to each owner": reduce_to_owners,
        "gather: all_gather_single (tensor)": lambda: gather_single(out_full, mine),
        "gather: all_gather (list)": lambda: dist.all_gather(out_chunks, mine),
        "gather: broadcast from each owner": broadcast_gather,
        "gather: all_reduce of zero-padded shard": all_reduce_gather,
        "local: memcpy of S (reference)": lambda: out_full.copy_(full),
    }


def _time_all(ops: dict[str, Op], repeat: int, device: torch.device) -> dict[str, float]:
    """Median seconds of every op over ``repeat`` rounds after one warm-up.

    Rounds interleave the candidates (a, b, c, a, b, c, ...) so that load
    from other processes on a shared machine hits them alike; every run
    starts from a barrier so that the ranks start together. Each op's value
    is the slowest rank's median: what a training step would wait for.
    """
    def sync() -> None:  # CUDA collectives return before they finish
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for op in ops.values():
        op()
    times: dict[str, list[float]] = {name: [] for name in ops}
    for _ in range(repeat):
        for name, op in ops.items():
            sync()
            dist.barrier()
            start = time.perf_counter()
            op()
            sync()
            times[name].append(time.perf_counter() - start)
    medians = torch.tensor([statistics.median(t) for t in times.values()], dtype=torch.float64,
                           device=device)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    return dict(zip(ops, medians.tolist()))


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    device = torch.device("cpu")
    if args.backend == "nccl":  # one GPU per rank, as a launcher's LOCAL_RANK would pick
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend, init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world,
                            **({"device_id": device} if device.type == "cuda" else {}))
    try:
        if rank == 0:
            print(f"torch {torch.__version__}, backend {args.backend}, {world} ranks, fp32, "
                  f"median of {args.repeat}; GB/s = buffer bytes / time", flush=True)
        for size_mb in args.sizes_mb:
            numel = int(size_mb * 1e6) // 4 // world * world
            if rank == 0:
                print(f"\n{size_mb:g} MB buffer:", flush=True)
            results = _time_all(_ops(numel, rank, world, device), args.repeat, device)
            for name, seconds in results.items():
                if rank == 0:
                    gbps = numel * 4 / seconds / 1e9
                    print(f"  {name:42s} {gbps:6.2f} GB/s  ({seconds * 1e3:8.2f} ms)",
                          flush=True)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 10, 100])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    args = parser.parse_args()
    if args.backend == "nccl":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < args.world:
            raise SystemExit(f"--backend nccl needs one CUDA device per rank: --world "
                             f"{args.world}, {gpus} device(s) here")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned ranks
    mp.spawn(_rank_main, args=(args.world, _free_port(), args), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
