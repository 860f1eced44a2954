"""The wire format between the launcher and a node agent.

One JSON object per line in each direction. End of the agent's stdin means
"stop now" (SSH cannot deliver signals, so a closed channel - the launcher
exited, was killed, or its connection dropped - is the agent's only sign
that the launcher is gone).

Phase 1, probe (optional; multi-host launches and ``dsrun doctor``). The
launcher writes zero or more ``probe`` commands; the agent answers each with
one ``facts`` event. Nothing is started; end of stdin here makes the agent
exit 0. The launcher probes the master host (node 0) first, then every
other host with the master's answer:

  {"cmd": "probe", "role": "master", "addr": A|null, "port": P|null,
   "peers": [names/addresses of another host], "single": bool}
      the agent settles the rendezvous: ``addr`` (given by --master_addr) or
      the source address of its route to a peer, else its host name's
      non-loopback address (127.0.0.1 when ``single``: one host only); and
      port ``port`` or a free one, which it keeps listening on until it
      starts its ranks, so the port stays free and can be tested.
  {"cmd": "probe", "role": "worker", "addr": A, "port": P, "timeout": s}
      the agent finds the interface that routes to A (for GLOO/NCCL
      _SOCKET_IFNAME) and tests a TCP connection to A:P.
  {"cmd": "probe", "role": null}
      facts only.

  facts  {host, pid, python, executable, dsrun, torch, devices, cpus, cwd,
          master: {addr, port, error}   (role master)
          ifname                        (master and worker)
          reach: {error, seconds}}      (role worker)

Phase 2, run. The launcher writes the start payload (an object without
``cmd``: job id, cwd, the user's ``env`` - values only ever here, never on a
command line - ``host_env`` defaults, ``path_prepend``, and per rank its
argv and dsrun variables), then may write ``{"cmd": "stop"}``. The agent
writes events on its stdout:

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
