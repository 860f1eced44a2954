"""Simulated cluster hosts for tests: network namespaces, each with its own sshd.

A :class:`SimCluster` builds, in the root network namespace, one Linux bridge
with a private /24, and per host a network namespace joined to the bridge by a
veth pair. Each host runs ``/usr/sbin/sshd -D`` inside its own UTS, mount and
IPC namespaces, so that it has its own ``hostname`` (``node1``..``nodeN``), an
``/etc/hosts`` that maps every node name to its bridge address (never to
127.0.0.1: gloo would pick loopback), and a private ``/dev/shm``. Files are
shared, like a shared home directory on a real cluster: the venv path works on
every host.

Invariants:

* Every name this module creates (namespaces, links, the temp dir) carries a
  per-run random tag, so concurrent or crashed runs never collide and teardown
  only ever touches what this run made. The subnet is chosen under a lock
  among those not present in ``ip -4 addr``/``ip -4 route``.
* Everything inside a host's network namespace belongs to this cluster, so
  ``ip netns pids`` is the exact list of processes a job left behind there.
* Processes are only ever signalled by PID (psutil objects, which refuse
  reused PIDs), never by name.
* ``teardown()`` is idempotent and runs even when ``start()`` failed halfway.
* Each run records its owner PID under REGISTRY_DIR before creating anything;
  a later ``start()`` tears down runs whose owner died without teardown
  (SIGKILL, crash). Live runs and unrecorded namespaces are never touched.

Requires root, iproute2, util-linux (unshare, nsenter) and OpenSSH.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import random
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

import psutil

log = logging.getLogger(__name__)

SSHD = "/usr/sbin/sshd"
SSH_PORT = 22
# Per-connection sshd processes (OpenSSH >= 9.8 names them sshd-session).
SSHD_NAMES = frozenset({"sshd", "sshd-session", "sshd-auth"})
SUBNET_BASE = "10.213"
# Lock and one record per live run (root-only, cleared at reboot).
REGISTRY_DIR = Path("/run/lock/dsrun-simhosts")
NAME_PREFIX = "dsr"

HostRef = Union["SimHost", str]


class SimClusterError(RuntimeError):
    """Building or changing the simulated cluster failed (message has the stderr)."""


@dataclass
class SimHost:
    """One simulated host. ``sshd_pid`` is None while its sshd is stopped."""

    index: int
    name: str
    netns: str
    address: str
    veth: str
    sshd_pid: Optional[int] = None


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        list(argv), stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30
    )
    if check and proc.returncode != 0:
        raise SimClusterError(f"{shlex.join(argv)} failed ({proc.returncode}): {proc.stderr}")
    return proc


def preflight(sshd: str = SSHD) -> Optional[str]:
    """Return why simulated hosts cannot be built here, or None when they can."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces, bridge, sshd)"
    if not os.access(sshd, os.X_OK):
        return f"sshd not found at {sshd} (apt-get install openssh-server)"
    for tool in ("ip", "unshare", "nsenter", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"{tool} not found on PATH"
    probe = f"{NAME_PREFIX}probe{secrets.token_hex(3)}"
    added = _run(["ip", "netns", "add", probe], check=False)
    if added.returncode != 0:
        return f"`ip netns add` failed: {added.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return None


def _used_subnets() -> set[int]:
    """Third octets of SUBNET_BASE.x.0/24 networks already in use in the root namespace."""
    text = _run(["ip", "-4", "-o", "addr", "show"]).stdout
    text += _run(["ip", "-4", "route", "show", "table", "all"]).stdout
    pattern = re.compile(r"(?<![\d.])" + re.escape(SUBNET_BASE) + r"\.(\d+)\.")
    return {int(m.group(1)) for m in pattern.finditer(text)}


def _link_names() -> set[str]:
    out = _run(["ip", "-o", "link", "show"]).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line}


def _netns_names() -> set[str]:
    out = _run(["ip", "netns", "list"]).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def same_process(pid: int, ctime: float) -> Optional[psutil.Process]:
    """The process ``pid`` if it is still the one that started at ``ctime``."""
    try:
        proc = psutil.Process(pid)
        return proc if abs(proc.create_time() - ctime) < 1.0 else None
    except psutil.NoSuchProcess:
        return None


def owner_record() -> dict[str, Any]:
    """This process, as a run's record names its owner."""
    me = psutil.Process()
    return {"owner_pid": me.pid, "owner_ctime": me.create_time()}


def owner_alive(record: dict[str, Any]) -> bool:
    """Whether a record's owner still runs (KeyError/TypeError/ValueError: a torn record)."""
    return same_process(int(record["owner_pid"]), float(record["owner_ctime"])) is not None


def _reap_dead_runs() -> None:
    """Tear down runs whose recorded owner process is gone (crashed, SIGKILLed).

    Runs of live processes, and namespaces without a record, are never touched.
    """
    for path in sorted(REGISTRY_DIR.glob("*.json")):
        try:
            record = json.loads(path.read_text())
            if owner_alive(record):
                continue
        except (OSError, ValueError, KeyError, TypeError):
            continue
        log.warning("tearing down sim cluster %s left by dead process %s",
                    record["tag"], record["owner_pid"])
        SimCluster._from_record(record).teardown()


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _signal_all(procs: Iterable[psutil.Process], kill: bool) -> None:
    for proc in procs:
        try:
            proc.kill() if kill else proc.terminate()
        except psutil.NoSuchProcess:
            pass


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until procs are gone (zombies count as gone); return those still alive."""
    deadline = time.monotonic() + timeout
    alive = [p for p in procs if _alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if _alive(p)]
    return alive


def kill_procs(procs: list[psutil.Process], grace: float = 2.0) -> list[psutil.Process]:
    """SIGTERM procs, wait ``grace`` seconds, SIGKILL the rest; return survivors."""
    _signal_all(procs, kill=False)
    alive = _wait_gone(procs, grace)
    _signal_all(alive, kill=True)
    return _wait_gone(alive, 2.0)


class SimCluster:
    """N simulated hosts reachable over SSH; see the module docstring.

    Use ``with SimCluster(4) as cluster:`` or ``start()``/``teardown()``.
    """

    def __init__(
        self,
        num_hosts: int = 4,
        *,
        sshd: str = SSHD,
        accept_env: Sequence[str] = ("DSRUN_*",),
        startup_timeout: float = 10.0,
    ) -> None:
        if num_hosts < 1 or num_hosts > 200:
            raise ValueError(f"num_hosts must be in 1..200, got {num_hosts}")
        self.num_hosts = num_hosts
        self.sshd = sshd
        self.accept_env = tuple(accept_env)
        self.startup_timeout = startup_timeout
        self.tag = ""
        self.hosts: list[SimHost] = []
        self.bridge = ""
        self.bridge_address = ""
        self.subnet = ""
        self.workdir: Optional[Path] = None
        self.startup_seconds: Optional[float] = None
        self._bridge_made = False
        self._netns_made: list[str] = []
        self._links_made: list[str] = []
        self._sshd: dict[str, subprocess.Popen[bytes]] = {}
        # Names of other long-running services started on the hosts (e.g.
        # slurmd): teardown kills them, leak checks do not report them.
        self.daemons: set[str] = set()

    # -- paths ---------------------------------------------------------------

    def _path(self, name: str) -> Path:
        if self.workdir is None:
            raise SimClusterError("cluster not started")
        return self.workdir / name

    @property
    def key_path(self) -> str:
        """Private client key (ed25519) accepted by every host as root."""
        return str(self._path("id_ed25519"))

    @property
    def known_hosts_path(self) -> str:
        """known_hosts with each host's key under its node name and its address."""
        return str(self._path("known_hosts"))

    @property
    def ssh_config_path(self) -> str:
        """ssh_config (for ``ssh -F`` or paramiko.SSHConfig) covering ``node*``."""
        return str(self._path("ssh_config"))

    @property
    def hosts_file_path(self) -> str:
        """The /etc/hosts seen inside every host."""
        return str(self._path("hosts"))

    def sshd_log_path(self, host: HostRef) -> str:
        return str(self._path(f"sshd-{self.host(host).name}.log"))

    # -- lifecycle -------------------------------------------------------------

    def __enter__(self) -> SimCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def start(self) -> SimCluster:
        """Build bridge, hosts and sshds; wait until every sshd accepts TCP."""
        if self.tag:
            raise SimClusterError("SimCluster.start() called twice")
        t0 = time.monotonic()
        keygens: list[subprocess.Popen[bytes]] = []
        try:
            self._make_bridge()
            keygens = self._start_keygens()
            for host in self.hosts:
                self._make_host_network(host)
            for proc in keygens:
                if proc.wait(timeout=30) != 0:
                    raise SimClusterError(f"ssh-keygen failed: {shlex.join(proc.args)}")
            self._write_files()
            os.makedirs("/run/sshd", exist_ok=True)
            for host in self.hosts:
                self._spawn_sshd(host)
            self._wait_listening(self.hosts)
        except BaseException:
            for proc in keygens:
                proc.wait()
            self.teardown()
            raise
        self.startup_seconds = time.monotonic() - t0
        log.info("sim cluster %s up in %.2fs: %s", self.tag, self.startup_seconds,
                 ", ".join(f"{h.name}={h.address}" for h in self.hosts))
        return self

    def _make_bridge(self) -> None:
        """Reap dead runs, choose tag and subnet, record the run, create the bridge.

        All under a machine-wide lock so that concurrent runs never pick the
        same names or subnet.
        """
        REGISTRY_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(REGISTRY_DIR / "lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            _reap_dead_runs()
            links, namespaces = _link_names(), _netns_names()
            while True:
                tag = secrets.token_hex(2)
                if f"{NAME_PREFIX}br{tag}" not in links and not any(
                    n.startswith(f"{NAME_PREFIX}{tag}-") for n in namespaces
                ):
                    break
            free = sorted(set(range(1, 255)) - _used_subnets())
            if not free:
                raise SimClusterError(f"no free {SUBNET_BASE}.x.0/24 subnet")
            self._adopt(tag, random.choice(free))
            self.workdir = Path(tempfile.mkdtemp(prefix=f"dsrun-sim-{tag}-"))
            self._write_record()
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            self._bridge_made = True
            _run(["ip", "addr", "add", f"{self.bridge_address}/24", "dev", self.bridge])
            _run(["ip", "link", "set", self.bridge, "up"])
        finally:
            os.close(fd)

    def _adopt(self, tag: str, octet: int) -> None:
        """Set every name and address that derives from the run's tag and subnet."""
        self.tag, self.bridge = tag, f"{NAME_PREFIX}br{tag}"
        self.subnet = f"{SUBNET_BASE}.{octet}.0/24"
        self.bridge_address = f"{SUBNET_BASE}.{octet}.1"
        self.hosts = [
            SimHost(
                index=i,
                name=f"node{i}",
                netns=f"{NAME_PREFIX}{tag}-h{i}",
                address=f"{SUBNET_BASE}.{octet}.{10 + i}",
                veth=f"{NAME_PREFIX}{tag}v{i}",
            )
            for i in range(1, self.num_hosts + 1)
        ]

    def _write_record(self) -> None:
        # Lets a later run tear this one down if this process dies without teardown().
        record = {**owner_record(), "tag": self.tag,
                  "octet": int(self.bridge_address.split(".")[2]),
                  "num_hosts": self.num_hosts, "workdir": str(self.workdir)}
        (REGISTRY_DIR / f"{self.tag}.json").write_text(json.dumps(record))

    @classmethod
    def _from_record(cls, record: dict[str, Any]) -> SimCluster:
        """A cluster object owning everything a dead run recorded, to tear it down."""
        cluster = cls(int(record["num_hosts"]))
        cluster._adopt(str(record["tag"]), int(record["octet"]))
        workdir = Path(record["workdir"])
        if workdir.name.startswith(f"dsrun-sim-{cluster.tag}-"):
            cluster.workdir = workdir
        cluster._bridge_made = True
        cluster._netns_made = [h.netns for h in cluster.hosts]
        cluster._links_made = [h.veth for h in cluster.hosts]
        return cluster

    def _start_keygens(self) -> list[subprocess.Popen[bytes]]:
        keys = [self.key_path] + [str(self._path(f"hostkey-{h.name}")) for h in self.hosts]
        return [
            subprocess.Popen(
                ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"dsrun-sim-{self.tag}",
                 "-f", key],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            )
            for key in keys
        ]

    def _make_host_network(self, host: SimHost) -> None:
        _run(["ip", "netns", "add", host.netns])
        self._netns_made.append(host.netns)
        _run(["ip", "link", "add", host.veth, "type", "veth",
              "peer", "name", "eth0", "netns", host.netns])
        self._links_made.append(host.veth)
        _run(["ip", "link", "set", host.veth, "master", self.bridge, "up"])
        ns = ["ip", "-n", host.netns]
        _run([*ns, "addr", "add", f"{host.address}/24", "dev", "eth0"])
        _run([*ns, "link", "set", "eth0", "up"])
        _run([*ns, "link", "set", "lo", "up"])

    def _write_files(self) -> None:
        lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
        lines += [f"{h.address}\t{h.name}" for h in self.hosts]
        Path(self.hosts_file_path).write_text("\n".join(lines) + "\n")
        Path(self._path("authorized_keys")).write_text(Path(self.key_path + ".pub").read_text())
        known = []
        for h in self.hosts:
            key_type, key = Path(self._path(f"hostkey-{h.name}.pub")).read_text().split()[:2]
            known.append(f"{h.name},{h.address} {key_type} {key}")
        Path(self.known_hosts_path).write_text("\n".join(known) + "\n")
        Path(self.ssh_config_path).write_text(self._ssh_config_text())
        for h in self.hosts:
            Path(self._path(f"sshd_config-{h.name}")).write_text(self._sshd_config_text(h))

    def _ssh_config_text(self) -> str:
        blocks = [f"Host {h.name}\n    HostName {h.address}\n" for h in self.hosts]
        pattern = f"node* {self.subnet.rsplit('.', 1)[0]}.*"
        blocks.append(
            f"Host {pattern}\n"
            "    User root\n"
            f"    Port {SSH_PORT}\n"
            f"    IdentityFile {self.key_path}\n"
            "    IdentitiesOnly yes\n"
            f"    UserKnownHostsFile {self.known_hosts_path}\n"
            "    GlobalKnownHostsFile /dev/null\n"
            "    StrictHostKeyChecking yes\n"
            "    BatchMode yes\n"
            "    ConnectTimeout 5\n"
            "    LogLevel ERROR\n"
            + "".join(f"    SendEnv {v}\n" for v in self.accept_env)
        )
        return "\n".join(blocks)

    def _sshd_config_text(self, host: SimHost) -> str:
        settings = [
            ("Port", str(SSH_PORT)),
            ("ListenAddress", host.address),
            ("HostKey", str(self._path(f"hostkey-{host.name}"))),
            ("PidFile", str(self._path(f"sshd-{host.name}.pid"))),
            ("AuthorizedKeysFile", str(self._path("authorized_keys"))),
            ("PubkeyAuthentication", "yes"),
            ("PasswordAuthentication", "no"),
            ("KbdInteractiveAuthentication", "no"),
            ("UsePAM", "no"),
            ("PermitRootLogin", "prohibit-password"),
            ("StrictModes", "no"),
            ("UseDNS", "no"),
            ("MaxStartups", "100:30:200"),
            ("MaxSessions", "100"),
            ("PrintMotd", "no"),
            ("PrintLastLog", "no"),
            ("X11Forwarding", "no"),
            ("Subsystem", "sftp internal-sftp"),
        ]
        settings += [("AcceptEnv", v) for v in self.accept_env]
        return "".join(f"{k} {v}\n" for k, v in settings)

    def _spawn_sshd(self, host: SimHost) -> None:
        q = shlex.quote
        script = (
            f"hostname {q(host.name)} && mount --bind {q(self.hosts_file_path)} /etc/hosts"
            " && mount -t tmpfs tmpfs /dev/shm"
            f" && exec {q(self.sshd)} -D -e -f {q(str(self._path(f'sshd_config-{host.name}')))}"
        )
        argv = ["ip", "netns", "exec", host.netns,
                "unshare", "--uts", "--mount", "--ipc", "--propagation", "private",
                "sh", "-c", script]
        with open(self.sshd_log_path(host), "ab") as logf:
            # ip netns exec, unshare (no --fork) and sh's exec all keep the PID:
            # proc.pid is the sshd listener. Own session: a Ctrl-C aimed at pytest
            # must not kill it before teardown runs.
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self._sshd[host.name] = proc
        host.sshd_pid = proc.pid

    def _wait_listening(self, hosts: list[SimHost]) -> None:
        deadline = time.monotonic() + self.startup_timeout
        pending = list(hosts)
        while pending:
            for host in list(pending):
                proc = self._sshd[host.name]
                if proc.poll() is not None:
                    tail = Path(self.sshd_log_path(host)).read_text(errors="replace")[-2000:]
                    raise SimClusterError(
                        f"sshd of {host.name} exited with {proc.returncode}:\n{tail}")
                try:
                    socket.create_connection((host.address, SSH_PORT), timeout=0.5).close()
                    pending.remove(host)
                except OSError:
                    pass
            if pending and time.monotonic() > deadline:
                names = ", ".join(h.name for h in pending)
                raise SimClusterError(f"sshd not listening after {self.startup_timeout}s: {names}")
            if pending:
                time.sleep(0.02)

    def teardown(self) -> None:
        """Kill everything in the hosts by PID, then delete links, namespaces, files."""
        for name in list(self._sshd):
            self._stop_listener(name)
        for _ in range(3):
            procs = [p for h in self.hosts for p in self._procs_in(h, include_sshd=True)]
            if not procs:
                break
            survivors = kill_procs(procs)
            for p in survivors:
                log.warning("process %d survived SIGKILL in sim cluster %s", p.pid, self.tag)
        for link in list(self._links_made):
            _run(["ip", "link", "del", link], check=False)
            self._links_made.remove(link)
        for ns in list(self._netns_made):
            res = _run(["ip", "netns", "del", ns], check=False)
            if res.returncode != 0:
                log.warning("ip netns del %s: %s", ns, res.stderr.strip())
            self._netns_made.remove(ns)
        if self._bridge_made:
            _run(["ip", "link", "del", self.bridge], check=False)
            self._bridge_made = False
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        if self.tag:
            (REGISTRY_DIR / f"{self.tag}.json").unlink(missing_ok=True)

    # -- hosts and commands ----------------------------------------------------

    def host(self, ref: HostRef) -> SimHost:
        """Look a host up by SimHost, node name, namespace name or address."""
        if isinstance(ref, SimHost):
            return ref
        for h in self.hosts:
            if ref in (h.name, h.netns, h.address):
                return h
        raise KeyError(f"no simulated host {ref!r}; hosts: {[h.name for h in self.hosts]}")

    def hostfile_text(self, slots: int = 2, hosts: Optional[Iterable[HostRef]] = None) -> str:
        """A DeepSpeed-style hostfile: one ``nodeN slots=S`` line per host."""
        chosen = self.hosts if hosts is None else [self.host(h) for h in hosts]
        return "".join(f"{h.name} slots={slots}\n" for h in chosen)

    def ssh_argv(self, host: HostRef, argv: Sequence[str]) -> list[str]:
        """The OpenSSH command line that runs argv on host as root."""
        return ["ssh", "-F", self.ssh_config_path, self.host(host).name, shlex.join(argv)]

    def ssh_run(
        self,
        host: HostRef,
        argv: Sequence[str],
        *,
        timeout: float = 60.0,
        input: Optional[str] = None,
        check: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """Run argv on host through ``ssh`` and capture its output as text."""
        return subprocess.run(
            self.ssh_argv(host, argv),
            input=input,
            stdin=subprocess.DEVNULL if input is None else None,
            capture_output=True, text=True, timeout=timeout, check=check,
        )

    def nsenter_argv(self, host: HostRef, argv: Sequence[str]) -> list[str]:
        """Command line that runs argv inside host's namespaces without SSH.

        Useful to start a launcher "on" a node (names resolve, hostname is the
        node's). Needs the host's sshd running: its namespaces are entered.
        """
        h = self.host(host)
        if h.sshd_pid is None:
            raise SimClusterError(f"sshd of {h.name} is stopped; its namespaces are gone")
        return ["nsenter", "--target", str(h.sshd_pid), "--net", "--uts", "--mount", "--ipc",
                "--", *argv]

    # -- processes -------------------------------------------------------------

    def pids_in(self, host: HostRef) -> list[int]:
        """PIDs in host's network namespace, less its sshd listener."""
        h = self.host(host)
        res = _run(["ip", "netns", "pids", h.netns], check=False)
        if res.returncode != 0:
            return []
        return sorted(int(p) for p in res.stdout.split() if int(p) != h.sshd_pid)

    def _procs_in(self, host: SimHost, include_sshd: bool) -> list[psutil.Process]:
        procs = []
        for pid in self.pids_in(host):
            try:
                proc = psutil.Process(pid)
                if not include_sshd and proc.name() in SSHD_NAMES | self.daemons:
                    continue
                if proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                procs.append(proc)
            except psutil.NoSuchProcess:
                continue
        return procs

    def strays(self) -> list[tuple[SimHost, psutil.Process]]:
        """Processes left on any host, other than sshd (listener and sessions)."""
        return [(h, p) for h in self.hosts for p in self._procs_in(h, include_sshd=False)]

    def assert_clean(self) -> None:
        """Raise AssertionError listing every process left on the hosts but sshd."""
        lines = []
        for host, proc in self.strays():
            try:
                cmd = shlex.join(proc.cmdline()) or f"[{proc.name()}]"
            except psutil.Error:
                cmd = "<exited>"
            lines.append(f"  {host.name}: pid {proc.pid}: {cmd}")
        if lines:
            raise AssertionError("processes left on simulated hosts:\n" + "\n".join(lines))

    def wait_clean(self, timeout: float = 5.0) -> None:
        """assert_clean(), retried for up to timeout seconds while processes exit."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.assert_clean()
                return
            except AssertionError:
                if time.monotonic() >= deadline:
                    raise
            time.sleep(0.1)

    def kill_strays(self) -> None:
        """Kill (by PID) every process assert_clean would report."""
        kill_procs([p for _, p in self.strays()])

    def _stop_listener(self, name: str) -> None:
        proc = self._sshd.pop(name, None)
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=3)
        self.host(name).sshd_pid = None

    def link_down(self, host: HostRef) -> None:
        """Cut host off the network (its bridge port goes down), as a dead
        switch port or a power loss would: its TCP connections stall, they
        do not close."""
        _run(["ip", "link", "set", self.host(host).veth, "down"])

    def link_up(self, host: HostRef) -> None:
        _run(["ip", "link", "set", self.host(host).veth, "up"])

    def stop_sshd(self, host: HostRef) -> None:
        """Stop host's sshd listener: new connections are refused (host "down").

        Existing sessions and their processes keep running, as on a real host
        whose sshd died.
        """
        self._stop_listener(self.host(host).name)

    def start_sshd(self, host: HostRef) -> None:
        """(Re)start host's sshd, in fresh UTS/mount/IPC namespaces, and wait for it."""
        h = self.host(host)
        if h.name in self._sshd:
            raise SimClusterError(f"sshd of {h.name} is already running")
        self._spawn_sshd(h)
        self._wait_listening([h])
