"""The hosts of a job and what they say: resolution and probing.

Used by the launch and by ``dsrun doctor`` alike.

:func:`resolve_cluster` turns the host options into a :class:`Cluster`
and its backend: the host pool (the hostfile; else what the backend offers,
e.g. a Slurm allocation; else this host), the selection (include/exclude,
num_nodes, num_gpus), which hosts are this machine, the backend (named by
--launcher, else local when every host is this one, else ssh) and that
backend's own checks - all before anything starts.

:func:`probe_cluster` runs the probe phase of protocol.py over a JobHandle
whose agents wait for their first line: the first agent of node 0 settles
the rendezvous (address, and a free port it holds), then the first agent
of every other node in parallel reports its interface to the master and
whether it reaches master:port. Each answer gets a verdict (preflight.py).
"""

from __future__ import annotations

import os
import queue
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dsrun.errors import DsrunUsageError, SelectionError
from dsrun.launcher.backends import get_backend
from dsrun.launcher.backends.base import Backend, HostPool, JobHandle
from dsrun.launcher.devices import (
    DeviceId,
    usable_cpu_list,
    usable_cpus,
    visible_devices,
    visible_devices_problem,
)
from dsrun.launcher.hostfile import (
    DEFAULT_JOB_HOSTFILE,
    MAX_SLOTS,
    HostEntry,
    Hostfile,
    host_problem,
    is_loopback_spelling,
    is_no_hostfile,
    resolve_hostfile,
)
from dsrun.launcher.netinfo import is_local_host, is_loopback, own_addresses
from dsrun.launcher.plan import NodeFacts
from dsrun.launcher.preflight import (
    Expectations,
    HostReport,
    Rendezvous,
    evaluate,
    same_machines,
)
from dsrun.launcher.resources import (
    NodeResources,
    highest_slot,
    select_resources,
    slot_count,
)
from dsrun.launcher.spec import DEFAULT_CPU_RANKS, HostsSpec

THIS_HOST = "<this host>"


@dataclass(frozen=True)
class Cluster:
    """The selected hosts of a job, in node order, and how to reach them."""

    source: str  # the hostfile path, or where the hosts came from
    hosts: tuple[str, ...]
    slots: tuple[tuple[int, ...], ...]
    local: tuple[bool, ...]
    launcher: str  # backend name
    named: bool = True  # False: placeholders until the agents connect (srun)

    @property
    def remote(self) -> bool:
        return not all(self.local)

    def renamed(self, hosts: Sequence[str]) -> Cluster:
        """The same cluster with the hosts the agents reported."""
        return replace(self, hosts=tuple(hosts), named=True)


def this_host_pool(hs: HostsSpec, devices: Sequence[DeviceId], cpus: int,
                   hostname: str) -> HostPool:
    """The pool of a job without a hostfile: this host (pure)."""
    name = hostname if host_problem(hostname) is None else "localhost"
    if hs.include is not None or hs.exclude is not None:
        # slots: this host's GPUs, or on a host without any, one per usable
        # CPU (CPU ranks; DeepSpeed with DS_ACCELERATOR=cpu runs these too);
        # CPU slots named beyond those oversubscribe, as --num_gpus N does,
        # and --num_gpus N after --exclude leaves N (the excluded slots come on top)
        named = highest_slot(hs.include)
        wanted = hs.num_gpus + slot_count(hs.exclude) if hs.num_gpus else 0
        count = len(devices) or min(max(cpus, 1, wanted,
                                        -1 if named is None else named + 1), MAX_SLOTS)
        return HostPool(Hostfile(THIS_HOST, (HostEntry(name, count, 0),)))
    if hs.num_nodes not in (None, 1):
        raise SelectionError(f"--num_nodes {hs.num_nodes} needs a hostfile: name one with "
                             f"-H/--hostfile (neither ./hostfile nor /job/hostfile exists)")
    if devices:
        if hs.num_gpus is not None and hs.num_gpus > len(devices):
            raise SelectionError(f"--num_gpus {hs.num_gpus} asks for more GPUs than this host "
                                 f"has ({len(devices)})")
        return HostPool(Hostfile(THIS_HOST, (HostEntry(name, len(devices), 0),)))
    count = hs.num_gpus or min(DEFAULT_CPU_RANKS, max(cpus, 1))
    return HostPool(Hostfile(THIS_HOST, (HostEntry(name, count, 0),)))


def cap_default(nodes: Sequence[NodeResources], default: int,
                include: str | None) -> tuple[NodeResources, ...]:
    """The selected slots under a pool's default ranks per host (a Slurm
    allocation's SLURM_NTASKS_PER_NODE), which is not a --num_gpus: at most
    ``default`` ranks per host, fewer where --include/--exclude left fewer
    slots, and every slot --include names for a host (pure)."""
    named = {part.split(":", 1)[0] for part in (include or "").split("@") if ":" in part}
    return tuple(n if n.host in named else NodeResources(n.host, n.slots[:default])
                 for n in nodes)


def resolve_cluster(hs: HostsSpec, cwd: str) -> tuple[Cluster, Backend]:
    """The job's hosts and backend; every check that needs no agent."""
    hostfile = resolve_hostfile(hs.hostfile, cwd)
    backend = get_backend(hs.launcher, hosts=hs) if hs.launcher else None
    pool = HostPool(hostfile) if hostfile is not None else \
        (backend.pool_without_hostfile() if backend is not None else None)
    if pool is None:
        devices = () if hs.cpu else visible_devices()
        pool = this_host_pool(hs, devices, usable_cpus(), socket.gethostname())
        if backend is not None and backend.hostfile_only:
            backend = None  # chosen below, as for any job on this host
    selecting = hs.include is not None or hs.exclude is not None
    num_gpus = hs.num_gpus if hs.num_gpus is not None or selecting else pool.default_ranks
    hostname, addresses = socket.gethostname(), own_addresses()
    this_host = None if pool.hostfile.path != THIS_HOST else \
        (lambda host: is_local_host(host, hostname, addresses))
    nodes = select_resources(pool.hostfile, hs.include, hs.exclude, hs.num_nodes, num_gpus,
                             this_host)
    if num_gpus is None and selecting and pool.default_ranks is not None:
        nodes = cap_default(nodes, pool.default_ranks, hs.include)
    hosts = tuple(n.host for n in nodes)
    if backend is None:
        here = [is_local_host(h, hostname, addresses) for h in hosts]
        backend = get_backend("local" if all(here) else "ssh", hosts=hs)
    local = backend.local_hosts(hosts, hostname, addresses) if pool.named \
        else [False] * len(hosts)
    problem = None if hs.cpu or not any(local) else visible_devices_problem()
    if problem is not None:  # the ranks here would find no GPU
        raise DsrunUsageError(problem)
    if sum(local) > 1:
        both = [h for h, is_local in zip(hosts, local) if is_local]
        raise SelectionError(f"hosts {both[0]} and {both[1]} in {pool.hostfile.path} are "
                             f"both this machine; list it once")
    cluster = Cluster(pool.hostfile.path, hosts, tuple(n.slots for n in nodes), tuple(local),
                      backend.name, pool.named)
    backend.check(cluster)
    return cluster, backend


def describe_source(hs: HostsSpec, cluster: Cluster, cwd: str) -> str:
    """Where the job's hosts come from, for the start banner and --dry-run:
    the hostfile and why it was chosen, or that there is none (pure)."""
    source = cluster.source
    if source == THIS_HOST and is_no_hostfile(hs.hostfile, cwd):
        return f"no hostfile: this host only (-H {hs.hostfile})"
    if source == THIS_HOST:
        return (f"no hostfile: this host only (neither ./hostfile nor {DEFAULT_JOB_HOSTFILE} "
                f"exists; -H names one)")
    if source.startswith("<") and source.endswith(">"):
        return f"hosts: {source[1:-1]}"
    if hs.hostfile is not None:
        return f"hostfile: {source} (-H)"
    if os.path.dirname(os.path.abspath(source)) == os.path.abspath(cwd):
        return (f"hostfile: {source} (found in the working directory; -H names another, "
                f"and without a hostfile the job runs on this host only)")
    return f"hostfile: {source} (the job hostfile; -H names another)"


def here_facts(cluster: Cluster) -> list[NodeFacts | None]:
    """What the launcher knows without probing: this host's own facts."""
    cpu_list = usable_cpu_list()
    mine = NodeFacts(visible_devices(), len(cpu_list), cpu_list=cpu_list)
    return [mine if is_local else None for is_local in cluster.local]


# --------------------------------------------------------------------------
# probing (I/O over a JobHandle)


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

    def node_facts(self) -> list[NodeFacts | None]:
        return [NodeFacts.from_probe(f) if f is not None else None for f in self.facts]


@dataclass
class _Probe:
    handle: JobHandle
    cluster: Cluster
    timeout: float
    deadline: float
    facts: list[dict[str, Any] | None]
    errors: list[str | None]
    deferred: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    ended: set[int] = field(default_factory=set)  # channels whose eof was seen

    def _lost(self, index: int, node: int) -> None:
        code = self.handle.channels[index].wait(timeout=1)
        self.errors[node] = self.handle.exit_message(index, code)

    def collect(self, pending: set[int]) -> None:
        """Answers from the leaders of ``pending`` nodes; other events wait."""
        by_channel = {self.handle.leaders[n]: n for n in pending}
        for index in list(by_channel):
            if index in self.ended:  # gone before it was asked
                self._lost(index, by_channel.pop(index))
        while by_channel:
            left = self.deadline - time.monotonic()
            if left <= 0:
                break
            try:
                index, msg = self.handle.events.get(timeout=left)
            except queue.Empty:
                break
            node = by_channel.get(index)
            ev = msg.get("ev")
            if ev == "eof":
                self.ended.add(index)
                self.deferred.append((index, msg))  # the supervisor needs it too
            if node is None or ev not in ("facts", "eof"):
                if ev != "eof":
                    self.deferred.append((index, msg))
                continue
            if ev == "facts":
                self.facts[node] = msg
            else:
                self._lost(index, node)
            del by_channel[index]
        for index, node in by_channel.items():
            # What the host printed instead (a forced command's refusal, a
            # login shell's prompt) is usually why it did not answer.
            self.errors[node] = (f"the node agent on {self.cluster.hosts[node]} did not answer "
                                 f"within {self.timeout:g}s (--ssh_timeout)"
                                 f"{self.handle.printed(index)}")

    def requeue(self) -> None:
        for item in self.deferred:
            self.handle.events.put(item)


def probe_cluster(handle: JobHandle, cluster: Cluster, backend: Backend, hs: HostsSpec,
                  versions: bool, expect: Expectations | None = None,
                  script: str | None = None,
                  log_files: Sequence[Sequence[str]] | None = None) -> ProbeOutcome:
    """Probe the master, then every other host; see the module docstring.

    ``versions``: also compare python/dsrun/torch versions with the launcher's.
    ``script``: a path every host must have (relative to the working directory).
    ``log_files``: per host, its ranks' ``--log_dir`` files, which it must be
    able to open (checked before any rank starts anywhere).
    """
    expect = expect or Expectations.here(versions)
    start = time.monotonic()
    n = len(cluster.hosts)
    st = _Probe(handle, cluster, hs.ssh.timeout, start + hs.ssh.timeout, [None] * n, [None] * n)
    peers, fallback = master_peers(cluster, backend)
    handle.send(handle.leaders[0], {"cmd": "probe", "role": "master", "addr": hs.master_addr,
                                    "port": hs.master_port, "peers": peers, "single": n == 1,
                                    "versions": versions, "script": script,
                                    "log_files": _host_logs(log_files, 0)})
    try:
        st.collect({0})
        master, master_problem = _rendezvous(cluster.hosts[0], st.facts[0], fallback)
        rest = {i for i in range(1, n) if st.errors[i] is None}
        for i in sorted(rest):
            request: dict[str, Any] = {"cmd": "probe", "role": None, "versions": versions,
                                       "script": script, "log_files": _host_logs(log_files, i)}
            if master is not None:
                request.update(role="worker", addr=master.addr, port=master.port,
                               timeout=min(hs.ssh.timeout, 5.0))
            handle.send(handle.leaders[i], request)
        st.collect(rest)
    finally:
        st.requeue()
    reports = [evaluate(host, st.facts[i], st.errors[i], expect, cluster.slots[i],
                        "master" if i == 0 else "worker", master,
                        master_problem if i == 0 else None, cpu=hs.cpu, script=script)
               for i, host in enumerate(cluster.hosts)]
    for i, problem in same_machines(cluster.hosts, st.facts).items():
        reports[i] = replace(reports[i], errors=(*reports[i].errors, problem))
    return ProbeOutcome(tuple(reports), master if master_problem is None else None,
                        time.monotonic() - start, tuple(st.facts))


def _host_logs(log_files: Sequence[Sequence[str]] | None, index: int) -> list[str]:
    if log_files is None or index >= len(log_files):
        return []
    return list(log_files[index])


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


def master_peers(cluster: Cluster, backend: Backend) -> tuple[list[str], str | None]:
    """Names of the second host (for the master's route) and the master's
    address as the launcher reaches it (last-resort master address)."""
    peers: list[str] = []
    if len(cluster.hosts) > 1:
        second = cluster.hosts[1]
        peers.append(second)
        if not cluster.local[1]:
            peers.append(backend.connect_address(second) or second)
    fallback = None if cluster.local[0] else backend.connect_address(cluster.hosts[0])
    return list(dict.fromkeys(peers)), fallback


def check_master(hs: HostsSpec, cluster: Cluster) -> None:
    """An explicit --master_addr or --master_port that cannot work on the
    master host is bad input; checked here when that host is this one (the
    master's agent checks it on another host, in the probe). A loopback
    address with more than one host is refused wherever the master is: the
    other hosts' ranks would dial their own machine."""
    if hs.master_addr and len(cluster.hosts) > 1 and is_loopback_spelling(hs.master_addr):
        raise DsrunUsageError(
            f"--master_addr {hs.master_addr} is this machine's loopback, but the job runs on "
            f"{len(cluster.hosts)} hosts: the ranks on {cluster.hosts[1]} would dial their own "
            f"machine, not the master; give an address of {cluster.hosts[0]} that the other "
            f"hosts reach, or leave --master_addr out")
    if not cluster.local[0]:
        return
    from dsrun.launcher.netinfo import master_addr_problem, port_problem

    problem = master_addr_problem(hs.master_addr) if hs.master_addr is not None else None
    if problem is None and hs.master_port is not None:
        problem = port_problem(hs.master_addr or "127.0.0.1", hs.master_port)
    if problem:
        raise DsrunUsageError(problem)
