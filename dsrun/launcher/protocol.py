"""The wire format between the launcher and a node agent.

One JSON object per line in each direction. The launcher writes the start
payload as the first line of the agent's stdin, then may write commands
(``{"cmd": "stop"}``); end of stdin means "stop now" (SSH cannot deliver
signals, so a closed channel is the agent's only sign that the launcher is
gone). The agent writes events on its stdout:

  hello    {host, pid}                     the agent is up
  started  {rank, pid}                     a rank process exists
  out      {rank, fd, line}                one line of rank output (fd 1|2)
  exit     {rank, code, signal, time, during_stop, error, tail}
  fatal    {message}                       the agent could not do its job
  done     {killed}                        every process of the job is gone

Environment values travel only inside the payload, never on a command line.
"""

from __future__ import annotations

import json
from typing import IO, Any


def encode(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, separators=(",", ":")) + "\n").encode()


def decode(line: bytes) -> dict[str, Any]:
    obj = json.loads(line)
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    return obj


def write(stream: IO[bytes], obj: dict[str, Any]) -> None:
    stream.write(encode(obj))
    stream.flush()
