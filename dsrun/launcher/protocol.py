"""The wire format between the launcher and a node agent.

One JSON object per line in each direction, over the agent's stdin/stdout
(local child, SSH exec channel) or over a TCP connection the agent opens
back to the launcher (agents started by mpirun or srun; see callback.py).
Either way the channel is the agent's lifeline: its end means "stop now"
(SSH cannot deliver signals, so a closed channel - the launcher exited, was
killed, or its connection dropped - is the agent's only sign that the
launcher is gone).

Connect-back handshake (callback.py). mpirun/srun start the agents with
three variables, passed by name only (``-x NAME`` / ``--export``), never
their values on a command line: :data:`LAUNCHER_VAR` (the launcher's
``addr:port`` candidates), :data:`SECRET_VAR` (a per-job secret) and
:data:`TIMEOUT_VAR`. The launcher opens with ``{"challenge": N1}``; the agent
answers ``{"ev": "connect", rank, local_rank, node, host, pid, "proof":
HMAC(secret, N1 and its rank), "challenge": N2}``; the launcher proves
itself with ``{"proof": HMAC(secret, N2)}``. The secret never crosses the
wire. After that the channel carries the phases below, as stdin/stdout do.

Phase 1, probe (optional; the launcher probes the first agent of each
host). The launcher writes zero or more ``probe`` commands; the agent
answers each with one ``facts`` event. Nothing is started; end of input
here makes the agent exit 0. The master host (node 0) is probed first, then
every other host with the master's answer:

  {"cmd": "probe", "role": "master", "addr": A|null, "port": P|null,
   "peers": [names/addresses of another host], "single": bool, "versions": bool}
      the agent settles the rendezvous: ``addr`` (given by --master_addr) or
      the source address of its route to a peer, else its host name's
      non-loopback address (127.0.0.1 when ``single``: one host only); and
      port ``port`` or a free one, which it keeps listening on until it
      starts its ranks, so the port stays free and can be tested.
  {"cmd": "probe", "role": "worker", "addr": A, "port": P, "timeout": s, ...}
      the agent finds the interface that routes to A (for GLOO/NCCL
      _SOCKET_IFNAME) and tests a TCP connection to A:P.
  {"cmd": "probe", "role": null, ...}
      facts only.

  facts  {host, pid, executable, devices, cpus, cwd,
          python, dsrun, torch           (when "versions" is true)
          master: {addr, port, error}   (role master)
          ifname                        (master and worker)
          reach: {error, seconds}}      (role worker)

Heartbeats, in every phase: ``{"cmd": "hb", "timeout": T}`` from the
launcher (first when the agent is up, then every T/4 seconds) tells the
agent to give up on a launcher silent for T seconds (T 0: never; before the
first heartbeat: link.FIRST_CONTACT). Once it knows T, the agent sends
``{"ev": "hb"}`` every T/4 seconds; the launcher counts any line as a
sign of life (link.py, supervisor.py).

Phase 2, run. The launcher writes the start payload, an object without
``cmd``: job id, cwd, kill grace, log dir, ``env`` (the user's variables:
values only ever here, never on a command line) and per rank its argv,
whether it runs the injected runtime (``runtime``) and its environment
layers (rankenv.py); then it may write commands (:data:`COMMANDS`):

  stop     {signal, failure}               stop every rank (SIGTERM, grace, SIGKILL;
                                           "signal": "SIGINT": SIGINT first, for a
                                           Ctrl-C of the launcher; "failure": true:
                                           a failure began the stop, so the grace is
                                           at most FAILURE_GRACE, agent_stop.py)
  kill                                     SIGKILL every rank now (a second Ctrl-C);
                                           end of input while stopping does the same
  stack    {req}                           each running rank's Python stacks
  pause / resume                           hold rank output / send it again (the
                                           launcher's console is behind: link.py)
  signal   {signal}                        forward "SIGUSR1"/"SIGUSR2" (that the
                                           launcher got) to every rank's process
                                           group; the job goes on (agent_forward.py)

The agent writes events:

  hello    {host, pid}                     the agent is up
  started  {rank, pid}                     a rank process exists
  out      {rank, fd, lines}               lines of rank output (fd 1|2), the
                                           lines of one read of the rank's pipe
  exit     {rank, code, signal, time, age, during_stop, error, tail}
           (age: seconds, on the agent's monotonic clock, between the
           failure and this event; the launcher orders failures by
           when it read the event less ``age``, never by ``time``)
  signal   {signal, time, age, during_stop}
           the agent itself got a stop signal (SIGTERM, SIGINT, SIGHUP:
           an admin, a scheduler, orted); it now stops its ranks, whose
           exits are consequences of it. It may come after those ranks'
           exit events (the signal reached the ranks first, or after the
           agent's loop ended), always before done
  fail     {message, time}                 the agent itself failed (a --log_dir file
                                           it cannot open or write, its guard killed,
                                           an error on any of its threads): the host
                                           fails, whatever its ranks did; the agent
                                           stops its ranks and still ends with done,
                                           and exits non-zero
  stack    {req, rank, pid, text, stopped} a rank's stacks (text null: no handler;
                                           stopped: it is stopped by a signal)
  stack_end {req}                          every running rank answered
  done     {killed, sigkilled, after, at_once, short}
           every process of the job is gone; killed: how many the final
           sweep SIGKILLed; sigkilled: the ranks that died of the agent's
           SIGKILL, still running after the stop's first signal ``after``
           ("SIGTERM", "SIGINT") for the kill grace, or hurried (at_once);
           short: the grace was a failure's (at most FAILURE_GRACE)

An agent ignores commands it does not know (from a newer launcher).
"""

from __future__ import annotations

import json
from typing import IO, Any

#: Commands the launcher may send once the job runs (and "hb" in every phase).
COMMANDS = ("stop", "kill", "stack", "pause", "resume", "signal")

#: The launcher's "addr:port" candidates, space-separated (IPv6 as [addr]:port).
LAUNCHER_VAR = "DSRUN_LAUNCHER"
#: The per-job secret agents prove they know (hex).
SECRET_VAR = "DSRUN_LAUNCHER_SECRET"
#: Seconds an agent tries to reach the launcher before giving up.
TIMEOUT_VAR = "DSRUN_LAUNCHER_TIMEOUT"
#: Variables for the agent itself: never passed on to the ranks.
AGENT_BOOTSTRAP_VARS = frozenset({LAUNCHER_VAR, SECRET_VAR, TIMEOUT_VAR})
#: The PYTHONPATH of the agent's login environment (":" + value; empty: unset),
#: when the agent was started with its ranks' PYTHONPATH (backends/agent_env.py);
#: the agent removes it from what its ranks inherit (agent_os.login_environ).
PYTHONPATH_WAS = "DSRUN_PYTHONPATH_WAS"


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
