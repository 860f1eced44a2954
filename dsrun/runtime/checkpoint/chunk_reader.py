"""Reading the chunks of a checkpoint's rank files, each checked against
its crc32 (step 3 of a load, :mod:`.reader`; also the consolidation of
:mod:`.consolidate`).

A chunk is read whole, so every byte a rank uses is checked; the checks
run in a helper thread while the next chunk is read, and
:meth:`ChunkReader.close` raises naming the first chunk that does not
match (its file, tensor, element range and bytes).
"""

from __future__ import annotations

import os
import zlib
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from dsrun.errors import CheckpointError
from dsrun.runtime.checkpoint.fragments import LoadTarget
from dsrun.runtime.checkpoint.manifest import (
    Item,
    Manifest,
    TensorEntry,
    itemsize,
    plan_reads,
    rank_file,
)
from dsrun.runtime.checkpoint.storage import read_into, torch_dtype


class ChunkReader:
    """Reads chunks of the rank files of one checkpoint and checks each
    one's crc32 - in a helper thread, while the next chunk is read; every
    check is done by :meth:`close`, which raises naming the first bad one."""

    def __init__(self, path: str, manifest: Manifest) -> None:
        self.path = path
        self.manifest = manifest
        self.fds: dict[int, int] = {}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="dsrun-crc")
        self.checks: list[tuple[Future, int, str]] = []

    def check_sizes(self) -> None:
        problems = []
        for name, info in self.manifest.files.items():
            full = os.path.join(self.path, name)
            try:
                size = os.stat(full).st_size
            except FileNotFoundError:
                problems.append(f"{full} is missing")
                continue
            if size != info.get("bytes", size):
                what = "truncated" if size < info["bytes"] else "longer than recorded"
                problems.append(f"{full} is {what}: {size} bytes, the manifest says "
                                f"{info['bytes']}")
        if problems:
            raise CheckpointError("; ".join(problems))

    def _fd(self, rank: int) -> int:
        if rank not in self.fds:
            self.fds[rank] = os.open(os.path.join(self.path, rank_file(rank)), os.O_RDONLY)
        return self.fds[rank]

    def fill(self, entry: TensorEntry, key: str, item: Item, target: LoadTarget,
             out: torch.Tensor) -> None:
        """Fill ``out`` (target elements ``[target.start, target.end)``)."""
        size = itemsize(item.dtype)
        stored = torch_dtype(item.dtype)
        for read in plan_reads(item, target.start, target.end):
            chunk = read.chunk
            whole = read.lo == chunk.start and read.hi == chunk.end
            dest = out[read.lo - target.start:read.hi - target.start]
            direct = whole and dest.device.type == "cpu" and dest.dtype == stored
            buffer = dest if direct else torch.empty(chunk.end - chunk.start, dtype=stored)
            view = memoryview(buffer.view(torch.uint8).numpy()).cast("B")
            file = os.path.join(self.path, rank_file(chunk.rank))
            read_into(self._fd(chunk.rank), file, chunk.offset, view)
            where = (f"{file} is corrupt: the checksum of tensor {entry.name!r} ({key}, elements "
                     f"[{chunk.start}, {chunk.end}), bytes {chunk.offset}-"
                     f"{chunk.offset + (chunk.end - chunk.start) * size}) does not match")
            self.checks.append((self.pool.submit(zlib.crc32, view), chunk.crc, where))
            if not direct:
                dest.copy_(buffer[read.lo - chunk.start:read.hi - chunk.start])

    def verify(self) -> None:
        """Wait for the checks of every chunk read so far; raise on a mismatch."""
        checks, self.checks = self.checks, []
        for done, expected, where in checks:
            if done.result() != expected:
                raise CheckpointError(where)

    def abandon(self) -> None:
        """Close the files without checking (after an error)."""
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        self.pool.shutdown(wait=True)
        self.checks = []

    def close(self) -> None:
        """Check every chunk read, then close the files."""
        try:
            self.verify()
        finally:
            self.abandon()
