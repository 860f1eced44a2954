"""The node agent before it has its part of the plan: connect back to the
launcher (agents started by mpirun/srun), then answer ``probe`` commands
until the start payload arrives (protocol.py).
"""

from __future__ import annotations

import os
import queue
from typing import TYPE_CHECKING, Any

from dsrun.launcher.agent_os import dsrun_sources, hostname, log_files_problem
from dsrun.launcher.link import END, Link

if TYPE_CHECKING:
    from dsrun.launcher import netinfo


def read_payload(link: Link) -> dict[str, Any] | None:
    """Answer probes until the start payload arrives; None: told to exit
    (or the launcher went silent); {}: an empty line (a broken launcher)."""
    held: netinfo.HeldPort | None = None
    try:
        while True:
            try:
                msg = link.get(0.2)
            except queue.Empty:
                if link.lost():
                    return None
                continue
            if msg is END:
                return None
            if not msg:
                return {}
            cmd = msg.get("cmd")
            if cmd is None:
                return msg
            if cmd != "probe":  # "stop" before the start: nothing to stop
                return None
            from dsrun.launcher import netinfo

            facts, port = netinfo.probe_reply(msg)
            facts.update(probe_extras(msg))
            if port is not None:
                if held is not None:
                    held.close()
                held = port
            link.send(facts)
    finally:
        # The master port is held until now: release it for rank 0's store.
        if held is not None:
            held.close()


def probe_extras(msg: dict[str, Any]) -> dict[str, Any]:
    """The probe's answers beyond netinfo's: which dsrun copy this agent
    runs (with the versions), and whether this host's ``--log_dir`` files
    of the job can be opened (``log_files``: the paths to try)."""
    extras: dict[str, Any] = {}
    if msg.get("versions", True):
        extras["dsrun_path"], extras["dsrun_digest"] = dsrun_sources()
    if msg.get("log_files"):
        extras["log_files"] = log_files_problem([str(p) for p in msg["log_files"]])
    return extras


def connect_link() -> Link:
    """Connect back to the launcher (agents started by mpirun/srun)."""
    from dsrun.launcher import callback

    who = callback.identity(os.environ)
    try:
        sock = callback.agent_connect(os.environ, who)
    except (OSError, ValueError, callback.HandshakeError) as exc:
        raise ConnectFailed(f"dsrun agent of rank {who.rank} on {hostname()}: "
                            f"cannot connect to the launcher: {exc}") from None
    return Link(sock.fileno(), sock.makefile("wb"), sock)


class ConnectFailed(Exception):
    """The agent could not reach the launcher (message for stderr)."""
