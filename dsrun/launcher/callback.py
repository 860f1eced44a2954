"""Agents that connect back to the launcher: both ends of the handshake.

When mpirun or srun start the agents, one command starts them all, so an
agent cannot get its part of the plan on its own stdin. Instead each agent
opens a TCP connection to the launcher (protocol.py, "Connect-back
handshake") and from then on that connection is its channel, exactly like
an SSH channel: probes, start payload, commands (stop; later heartbeats and
stack requests) one way, events the other, and its end means "stop now".

Trust: the launcher and the agents share a per-job secret that reaches the
agents as an environment variable passed by name. Each side proves it
knows the secret with an HMAC over a nonce the other side chose, so the
secret never crosses the network and a stray or replayed connection is
refused before anything is sent to it.

Pure parts (:func:`proof`, :func:`format_endpoints`, :func:`parse_endpoints`,
:func:`identity`) are unit-tested; :func:`agent_connect` and
:func:`server_handshake` do the I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dsrun.launcher import protocol
from dsrun.launcher.netinfo import host_port

HANDSHAKE_TIMEOUT = 10.0
MAX_LINE = 65536


class HandshakeError(Exception):
    """The other side failed the handshake (message says how)."""


def new_secret() -> str:
    return secrets.token_hex(32)


def proof(secret: str, *parts: object) -> str:
    """HMAC-SHA256 of ``parts`` under ``secret`` (hex)."""
    message = "\0".join(str(p) for p in parts).encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def format_endpoints(addresses: Sequence[str], port: int) -> str:
    return " ".join(host_port(a, port) for a in addresses)


def parse_endpoints(value: str) -> list[tuple[str, int]]:
    """``"10.0.0.1:5 [fe80::1]:5"`` -> ``[("10.0.0.1", 5), ("fe80::1", 5)]``."""
    out = []
    for word in value.split():
        host, sep, port = word.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise ValueError(f"bad launcher address {word!r} in {protocol.LAUNCHER_VAR}")
        out.append((host.strip("[]"), int(port)))
    if not out:
        raise ValueError(f"{protocol.LAUNCHER_VAR} names no address")
    return out


@dataclass(frozen=True)
class Identity:
    """Which process of the launching tool's job this agent is."""

    rank: int
    local_rank: int
    source: str


# (source, rank variable, local rank variable), first match wins
_IDENTITY_VARS = (
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("Slurm", "SLURM_PROCID", "SLURM_LOCALID"),
    ("PMI", "PMI_RANK", "MPI_LOCALRANKID"),
)


def identity(environ: Mapping[str, str]) -> Identity:
    for source, rank, local in _IDENTITY_VARS:
        if rank in environ:
            try:
                return Identity(int(environ[rank]), int(environ.get(local, "0")), source)
            except ValueError:
                raise ValueError(f"{rank}={environ[rank]!r} is not an integer") from None
    names = ", ".join(v[1] for v in _IDENTITY_VARS)
    raise ValueError(f"started with --connect but none of {names} is set: the agent must be "
                     f"started by mpirun or srun")


def read_line(sock: socket.socket) -> bytes:
    """One line, read byte-wise so nothing after it is consumed."""
    buf = bytearray()
    while len(buf) < MAX_LINE:
        b = sock.recv(1)
        if not b:
            raise HandshakeError("connection closed during the handshake")
        if b == b"\n":
            return bytes(buf)
        buf += b
    raise HandshakeError("handshake line too long")


def _send(sock: socket.socket, obj: dict[str, Any]) -> None:
    sock.sendall(protocol.encode(obj))


def _recv(sock: socket.socket) -> dict[str, Any]:
    try:
        return protocol.decode(read_line(sock))
    except ValueError as exc:
        raise HandshakeError(f"not a handshake message: {exc}") from None


# --------------------------------------------------------------------------
# launcher side


def server_handshake(conn: socket.socket, secret: str,
                     timeout: float = HANDSHAKE_TIMEOUT) -> dict[str, Any]:
    """Authenticate a connecting agent; return its ``connect`` message."""
    conn.settimeout(timeout)
    nonce = secrets.token_hex(16)
    _send(conn, {"challenge": nonce})
    hello = _recv(conn)
    if hello.get("ev") != "connect" or not isinstance(hello.get("rank"), int):
        raise HandshakeError("expected a connect message with a rank")
    if not hmac.compare_digest(str(hello.get("proof", "")),
                               proof(secret, "agent", nonce, hello["rank"])):
        raise HandshakeError("wrong proof of the job secret")
    _send(conn, {"proof": proof(secret, "launcher", hello.get("challenge", ""))})
    conn.settimeout(None)
    return hello


# --------------------------------------------------------------------------
# agent side


def _dial(endpoints: Sequence[tuple[str, int]], deadline: float) -> socket.socket:
    errors: dict[str, str] = {}
    while True:
        for host, port in endpoints:
            left = deadline - time.monotonic()
            if left <= 0:
                tried = "; ".join(f"{k}: {v}" for k, v in errors.items())
                raise OSError(f"cannot reach the launcher ({tried or 'no time left'})")
            try:
                return socket.create_connection((host, port), timeout=min(left, 3.0))
            except OSError as exc:
                errors[host_port(host, port)] = exc.strerror or str(exc)
        time.sleep(0.2)


def agent_connect(environ: Mapping[str, str], who: Identity) -> socket.socket:
    """Connect to the launcher named in the environment and authenticate."""
    secret = environ.get(protocol.SECRET_VAR, "")
    if not secret:
        raise ValueError(f"{protocol.SECRET_VAR} is not set")
    endpoints = parse_endpoints(environ.get(protocol.LAUNCHER_VAR, ""))
    timeout = float(environ.get(protocol.TIMEOUT_VAR) or HANDSHAKE_TIMEOUT)
    sock = _dial(endpoints, time.monotonic() + timeout)
    try:
        sock.settimeout(timeout)
        challenge = _recv(sock).get("challenge", "")
        mine = secrets.token_hex(16)
        _send(sock, {"ev": "connect", "rank": who.rank, "local_rank": who.local_rank,
                     "source": who.source, "host": socket.gethostname(), "pid": os.getpid(),
                     "proof": proof(secret, "agent", challenge, who.rank), "challenge": mine})
        answer = _recv(sock)
        if not hmac.compare_digest(str(answer.get("proof", "")),
                                   proof(secret, "launcher", mine)):
            raise HandshakeError("the launcher did not prove it knows the job secret")
        sock.settimeout(None)
        return sock
    except BaseException:
        sock.close()
        raise
