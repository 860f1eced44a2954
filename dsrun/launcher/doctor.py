"""Knowing and checking the hosts of a job: ``dsrun doctor`` and the preflight.

:func:`resolve_cluster` turns the host options into the hosts a job runs on
(hostfile, selection, which entries are this machine, which backend).
:func:`probe` runs the probe phase of protocol.py over a JobHandle whose
agents are waiting for their first line: the master host first (it settles
the rendezvous address and holds a free port), then every other host in
parallel (interface to the master, TCP reachability of master:port).
:func:`evaluate` turns one host's answer into a :class:`HostReport` (pure):

- errors: the job cannot run there (unreachable, no agent, working
  directory missing, fewer GPUs than selected slots, master port taken);
- mismatches: python/dsrun/torch versions differ from the launcher's, or
  master:port is not reachable from the host; these fail the preflight
  unless ``--no_preflight``.

``dsrun doctor`` prints one line per host and exits 1 naming the failing
hosts. A multi-host ``dsrun run`` does the same probe before sending any
start payload, so a failed preflight starts no rank anywhere.
"""

from __future__ import annotations

import platform
import queue
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import click

from dsrun import __version__
from dsrun.errors import DsrunUsageError, LaunchError, SelectionError
from dsrun.launcher.backends import get_backend
from dsrun.launcher.backends.base import Backend, JobHandle
from dsrun.launcher.devices import visible_devices
from dsrun.launcher.hostfile import local_hostfile, resolve_hostfile
from dsrun.launcher.netinfo import (
    is_local_host,
    is_loopback,
    own_addresses,
    package_version,
)
from dsrun.launcher.resources import select_resources
from dsrun.launcher.spec import DEFAULT_CPU_RANKS, HostsSpec


class PreflightFailed(LaunchError):
    """Some host cannot run the job; nothing was started."""


# --------------------------------------------------------------------------
# which hosts


@dataclass(frozen=True)
class Cluster:
    """The selected hosts of a job, in node order, and how to reach them."""

    source: str  # the hostfile path, or "<local>"
    hosts: tuple[str, ...]
    slots: tuple[tuple[int, ...], ...]
    local: tuple[bool, ...]
    launcher: str  # backend name

    @property
    def remote(self) -> bool:
        return not all(self.local)


def resolve_cluster(hs: HostsSpec, cwd: str) -> tuple[Cluster, Backend] | None:
    """The job's hosts and backend; None: a plain local job (no hostfile)."""
    hostfile = resolve_hostfile(hs.hostfile, cwd)
    if hostfile is None:
        if hs.launcher == "ssh":
            raise SelectionError("--launcher ssh needs a hostfile: name one with -H/--hostfile"
                                 " (neither ./hostfile nor /job/hostfile exists)")
        if hs.include is None and hs.exclude is None:
            if hs.num_nodes not in (None, 1):
                raise SelectionError(
                    f"--num_nodes {hs.num_nodes} needs a hostfile: name one with -H/--hostfile"
                    f" (neither ./hostfile nor /job/hostfile exists)")
            return None
        devices = visible_devices()
        if not devices:
            raise SelectionError(
                "--include/--exclude without a hostfile select GPUs of this host, which has "
                "none; use --num_gpus N for CPU ranks, or name a hostfile with -H")
        hostfile = local_hostfile(len(devices))
    nodes = select_resources(hostfile, hs.include, hs.exclude, hs.num_nodes, hs.num_gpus)
    hosts = tuple(n.host for n in nodes)
    hostname, addresses = socket.gethostname(), own_addresses()
    local = [is_local_host(h, hostname, addresses) for h in hosts]
    name = hs.launcher or ("local" if all(local) else "ssh")
    backend = get_backend(name, options=hs.ssh) if name == "ssh" else get_backend(name)
    if name == "ssh":
        local = [is_local or backend.is_local(h, hostname, addresses)  # type: ignore[attr-defined]
                 for h, is_local in zip(hosts, local)]
    elif not all(local):
        remote = hosts[local.index(False)]
        raise DsrunUsageError(f"--launcher local cannot start ranks on {remote} "
                              f"(from {hostfile.path}), which is not this host; use ssh")
    if sum(local) > 1:
        both = [h for h, is_local in zip(hosts, local) if is_local]
        raise SelectionError(f"hosts {both[0]} and {both[1]} in {hostfile.path} are both "
                             f"this machine; list it once")
    cluster = Cluster(hostfile.path, hosts, tuple(n.slots for n in nodes), tuple(local), name)
    return cluster, backend


# --------------------------------------------------------------------------
# probing (I/O over a JobHandle)


@dataclass(frozen=True)
class Expectations:
    """What every host should match: the launcher's own versions."""

    python: str
    dsrun: str
    torch: str | None

    @classmethod
    def here(cls) -> Expectations:
        return cls(platform.python_version(), __version__, package_version("torch"))


@dataclass(frozen=True)
class Rendezvous:
    addr: str
    port: int


@dataclass(frozen=True)
class HostReport:
    host: str
    facts: dict[str, Any] | None
    errors: tuple[str, ...] = ()
    mismatches: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def ok(self, strict: bool = True) -> bool:
        return not self.errors and not (strict and self.mismatches)

    def line(self, width: int = 0, strict: bool = True) -> str:
        status = "ok  " if self.ok(strict) else "FAIL"
        text = "; ".join((*self.errors, *self.mismatches)) if not self.ok(strict) \
            else ", ".join(self.notes)
        return f"{self.host:<{width}}  {status}  {text}"


@dataclass(frozen=True)
class ProbeOutcome:
    reports: tuple[HostReport, ...]
    master: Rendezvous | None
    seconds: float
    facts: tuple[dict[str, Any] | None, ...] = field(default=())

    def failed(self, strict: bool = True) -> list[HostReport]:
        return [r for r in self.reports if not r.ok(strict)]

    def lines(self, strict: bool = True) -> list[str]:
        width = max(len(r.host) for r in self.reports)
        return [r.line(width, strict) for r in self.reports]


def probe(handle: JobHandle, cluster: Cluster, hs: HostsSpec, expect: Expectations,
          peers: Sequence[str], fallback_addr: str | None, timeout: float) -> ProbeOutcome:
    """Probe the master, then every other host; see the module docstring."""
    start = time.monotonic()
    deadline = start + timeout
    n = len(cluster.hosts)
    facts: list[dict[str, Any] | None] = [None] * n
    errors: list[str | None] = [None] * n
    handle.send(0, {"cmd": "probe", "role": "master", "addr": hs.master_addr,
                    "port": hs.master_port, "peers": list(peers), "single": n == 1})
    _collect(handle, cluster, {0}, facts, errors, deadline, timeout)
    master, master_problem = _rendezvous(cluster.hosts[0], facts[0], fallback_addr)
    rest = {i for i in range(1, n) if errors[i] is None}
    for i in sorted(rest):
        request: dict[str, Any] = {"cmd": "probe", "role": None}
        if master is not None:
            request = {"cmd": "probe", "role": "worker", "addr": master.addr,
                       "port": master.port, "timeout": min(timeout, 5.0)}
        handle.send(i, request)
    _collect(handle, cluster, rest, facts, errors, deadline, timeout)
    reports = []
    for i, host in enumerate(cluster.hosts):
        role = "master" if i == 0 else "worker"
        extra = master_problem if i == 0 else None
        reports.append(evaluate(host, facts[i], errors[i], expect, cluster.slots[i], role,
                                master, extra, cpu=hs.cpu))
    return ProbeOutcome(tuple(reports), master if master_problem is None else None,
                        time.monotonic() - start, tuple(facts))


def _collect(handle: JobHandle, cluster: Cluster, pending: set[int],
             facts: list[dict[str, Any] | None], errors: list[str | None],
             deadline: float, timeout: float) -> None:
    pending = set(pending)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            index, msg = handle.events.get(timeout=left)
        except queue.Empty:
            break
        ev = msg.get("ev")
        if ev == "facts":
            facts[index] = msg
            pending.discard(index)
        elif ev == "eof" and facts[index] is None and errors[index] is None:
            code = handle.channels[index].wait(timeout=1)
            errors[index] = handle.exit_message(index, code)
            pending.discard(index)
    for index in pending:
        errors[index] = (f"the node agent on {cluster.hosts[index]} did not answer within "
                         f"{timeout:g}s (--ssh_timeout)")


def _rendezvous(host: str, facts: dict[str, Any] | None,
                fallback_addr: str | None) -> tuple[Rendezvous | None, str | None]:
    if facts is None:
        return None, None  # the master's own error says why
    master = facts.get("master") or {}
    if master.get("error"):
        return None, f"master {master['error']}"
    addr = master.get("addr")
    if not addr and fallback_addr and not is_loopback(fallback_addr):
        addr = fallback_addr
    if not addr:
        return None, (f"cannot find an address of {host} that the other hosts reach "
                      f"(its host name resolves to loopback); pass --master_addr")
    return Rendezvous(str(addr), int(master["port"])), None


# --------------------------------------------------------------------------
# checking (pure)


def _version_mismatches(facts: dict[str, Any], expect: Expectations) -> list[str]:
    out = []
    if facts.get("python") != expect.python:
        out.append(f"python {facts.get('python')} (launcher: {expect.python})")
    if facts.get("dsrun") != expect.dsrun:
        out.append(f"dsrun {facts.get('dsrun')} (launcher: {expect.dsrun})")
    if expect.torch is not None and facts.get("torch") != expect.torch:
        have = facts.get("torch") or "not installed"
        out.append(f"torch {have} (launcher: {expect.torch})")
    return out


def _slot_check(host: str, devices: Sequence[int], slots: Sequence[int],
                cpu: bool = False) -> tuple[str | None, str]:
    if cpu:
        return None, f"--cpu: {len(slots)} CPU rank(s)"
    if not devices:
        return None, f"no GPU: {len(slots)} CPU rank(s)"
    need = max(slots) + 1
    if len(devices) < need:
        return (f"{host} has {len(devices)} GPU(s) but slots up to index {need - 1} are "
                f"selected"), ""
    return None, f"{len(slots)} GPU rank(s) of {len(devices)} GPU(s)"


def evaluate(host: str, facts: dict[str, Any] | None, error: str | None,
             expect: Expectations, slots: Sequence[int], role: str,
             master: Rendezvous | None, master_problem: str | None = None,
             cpu: bool = False) -> HostReport:
    """One host's verdict from its probe answer (or the error instead of one);
    ``cpu``: the job asked for CPU ranks (--cpu), so GPUs are not checked."""
    if facts is None:
        return HostReport(host, None, errors=(error or "no answer",))
    errors: list[str] = []
    notes = [f"{facts.get('host')}: python {facts.get('python')}",
             f"dsrun {facts.get('dsrun')}", f"torch {facts.get('torch') or '-'}"]
    problem, note = _slot_check(host, facts.get("devices") or [], slots, cpu)
    if problem:
        errors.append(problem)
    else:
        notes.append(note)
    if master_problem:
        errors.append(master_problem)
    mismatches = _version_mismatches(facts, expect)
    if role == "master" and master is not None:
        notes.append(f"master {master.addr}:{master.port} (port free, held)")
    reach = facts.get("reach")
    if reach is not None and reach.get("error"):
        mismatches.append(f"cannot reach the master: {reach['error']}")
    elif reach is not None and master is not None:
        notes.append(f"reaches master {master.addr}:{master.port}")
    if facts.get("ifname"):
        notes.append(f"via {facts['ifname']}")
    return HostReport(host, facts, tuple(errors), tuple(mismatches), tuple(notes))


# --------------------------------------------------------------------------
# running a probe for a cluster (shared by doctor and run)


def master_peers(cluster: Cluster, backend: Backend) -> tuple[list[str], str | None]:
    """Names of the second host (for the master's route) and the master's
    address as the launcher reaches it (last-resort master address)."""
    address_of = getattr(backend, "connect_address", None)
    peers: list[str] = []
    if len(cluster.hosts) > 1:
        second = cluster.hosts[1]
        peers.append(second)
        if address_of is not None and not cluster.local[1]:
            peers.append(address_of(second))
    fallback = None
    if address_of is not None and not cluster.local[0]:
        fallback = address_of(cluster.hosts[0])
    return list(dict.fromkeys(peers)), fallback


def probe_cluster(handle: JobHandle, cluster: Cluster, backend: Backend, hs: HostsSpec,
                  expect: Expectations | None = None) -> ProbeOutcome:
    peers, fallback = master_peers(cluster, backend)
    return probe(handle, cluster, hs, expect or Expectations.here(), peers, fallback,
                 hs.ssh.timeout)


def run_doctor(hs: HostsSpec, cwd: str, echo=click.echo) -> int:
    """``dsrun doctor``: one line per host; 0 when every host passes."""
    resolved = resolve_cluster(hs, cwd)
    if resolved is None:
        devices = () if hs.cpu else visible_devices()
        count = hs.num_gpus or len(devices) or DEFAULT_CPU_RANKS
        cluster = Cluster("<local>", (socket.gethostname(),), (tuple(range(count)),),
                          (True,), "local")
        backend = get_backend("local")
    else:
        cluster, backend = resolved
    echo(f"checking {len(cluster.hosts)} host(s) from {cluster.source} "
         f"(launcher: {cluster.launcher}, working directory {cwd})")
    handle = backend.open(cluster.hosts, cwd, cluster.local)
    try:
        outcome = probe_cluster(handle, cluster, backend, hs)
    finally:
        handle.close()
    for line in outcome.lines():
        echo(f"  {line}")
    failed = outcome.failed()
    if failed:
        names = ", ".join(r.host for r in failed)
        raise PreflightFailed(f"{len(failed)} of {len(cluster.hosts)} host(s) failed: {names}")
    echo(f"all {len(cluster.hosts)} host(s) ok ({outcome.seconds:.2f}s)")
    return 0

