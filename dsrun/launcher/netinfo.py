"""What a host looks like to a job: its names, addresses, interfaces, ports.

Used on both sides of the probe phase (protocol.py): the launcher decides
which hostfile entries are this host (:func:`is_local_host`); each node agent
answers a ``probe`` (:func:`probe_reply`) with its facts: versions, devices,
CPUs and, depending on its role,

- master: the rendezvous address as the other hosts see it (the source
  address of the route to the second host, else the address its host name
  resolves to when that is not loopback) and a free port, which it keeps
  *listening* until its ranks start, so that no one else takes it and the
  other hosts can test that they reach it;
- worker: the interface that routes to the master (for GLOO_SOCKET_IFNAME /
  NCCL_SOCKET_IFNAME) and whether a TCP connection to master:port succeeds.

The choices are pure functions over data (:func:`choose_master_addr`,
:func:`interface_for`); the rest is thin I/O. Rank 0 of a job started by
mpirun or srun uses the same functions to find its address (runtime
rendezvous.py). On the launcher, names are resolved only to order the
addresses agents started by mpirun/srun try when they connect back.
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import os
import socket
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost",
                            "ip6-loopback"})
LOCAL_MASTER = "127.0.0.1"


# --------------------------------------------------------------------------
# pure


def host_port(addr: str, port: int | str) -> str:
    """``addr:port`` as people and URLs write it: an IPv6 address in
    brackets (``[fd21::11]:29500``), where ``fd21::11:29500`` would read
    as one address."""
    return f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr.split("%")[0]).is_loopback
    except ValueError:
        return False


@functools.lru_cache(maxsize=4096)
def _addr_key(addr: str) -> str | None:
    try:
        return str(ipaddress.ip_address(addr.split("%")[0]))
    except ValueError:
        return None


@functools.lru_cache(maxsize=64)
def _local_keys(addresses: tuple[str, ...]) -> frozenset[str]:
    return frozenset(k for k in (_addr_key(a) for a in addresses) if k)


def is_local_host(host: str, hostname: str, addresses: Iterable[str],
                  resolved: str | None = None) -> bool:
    """Whether hostfile entry ``host`` is this machine.

    ``hostname`` is this host's name, ``addresses`` its interface addresses,
    ``resolved`` the address the entry maps to without DNS (an ssh_config
    HostName), if any. Names match case-insensitively, also by first label
    (``node1`` is ``node1.cluster``).
    """
    name = host.lower().rstrip(".")
    own = hostname.lower().rstrip(".")
    if name in LOOPBACK_NAMES:
        return True
    if _addr_key(name) is None and own:
        # short name vs fully qualified name of the same host, either way round
        if name == own or name == own.split(".")[0] or own == name.split(".")[0]:
            return True
    local = _local_keys(tuple(addresses))
    for candidate in (host, resolved):
        key = _addr_key(candidate) if candidate else None
        if key is not None and (is_loopback(key) or key in local):
            return True
    return False


def choose_master_addr(route_sources: Sequence[str | None],
                       hostname_addrs: Sequence[str]) -> str | None:
    """The master's address as other hosts see it, or None if unknown.

    First choice: the source address of the master's route to another host
    of the job (the interface the traffic really leaves through); then the
    first non-loopback address its host name resolves to.
    """
    for addr in route_sources:
        if addr and not is_loopback(addr):
            return addr
    for addr in hostname_addrs:
        if not is_loopback(addr):
            return addr
    return None


def interface_for(addr: str, if_addrs: Mapping[str, Sequence[str]]) -> str | None:
    """Name of the interface that holds ``addr`` (None for loopback/unknown)."""
    key = _addr_key(addr)
    if key is None or is_loopback(key):
        return None
    for name, addrs in if_addrs.items():
        if any(_addr_key(a) == key for a in addrs):
            return name
    return None


# --------------------------------------------------------------------------
# host I/O


def interface_addresses() -> dict[str, list[str]]:
    """Interface name -> its IPv4/IPv6 addresses."""
    import psutil

    out: dict[str, list[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        out[name] = [a.address for a in addrs
                     if a.family in (socket.AF_INET, socket.AF_INET6)]
    return out


def own_addresses() -> list[str]:
    return [a for addrs in interface_addresses().values() for a in addrs]


def route_source(host: str) -> str | None:
    """Source address of this host's route to ``host`` (no packet is sent)."""
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(sockaddr)
                return str(s.getsockname()[0])
        except OSError:
            continue
    return None


def route_interface(addr: str) -> str | None:
    """The interface traffic to ``addr`` leaves through (None: loopback/unknown)."""
    source = route_source(addr)
    return interface_for(source, interface_addresses()) if source else None


def hostname_addresses() -> list[str]:
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    return [str(info[4][0]) for info in infos]


#: Where dsrun picks a master port when none is given: below the kernel's
#: ephemeral range (ip_local_port_range), like torchrun's 29500.
PORT_FLOOR = 20000


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    try:
        with open(path, encoding="ascii") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def bind_below_ephemeral(sock: socket.socket, tries: int = 64) -> None:
    """Bind ``sock`` to a free port below the ephemeral range. A port the
    kernel hands out (bind to 0) lies inside it, where any process's next
    outgoing connection may take it as its source port in the seconds
    before rank 0's store binds it again (EADDRINUSE, seen on a busy host);
    the kernel never picks ports below the range for that. Falls back to
    the kernel's choice where the range leaves no room below it."""
    low = ephemeral_range()[0]
    for _ in range(tries if low - PORT_FLOOR > 1000 else 0):
        pick = PORT_FLOOR + int.from_bytes(os.urandom(4), "little") % (low - PORT_FLOOR)
        try:
            sock.bind(("", pick))
            return
        except OSError as exc:
            if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
                raise
    sock.bind(("", 0))


class HeldPort:
    """A listening socket that reserves a port until the ranks start.

    Connections from other hosts' reachability checks are accepted and
    drained in a daemon thread; the clients close first, so no TIME_WAIT is
    left on this side (and TCPStore binds with SO_REUSEADDR anyway).
    """

    def __init__(self, port: int | None, addr: str | None) -> None:
        family = socket.AF_INET6 if addr and ":" in addr else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            if port:
                self.sock.bind(("", port))
            else:
                bind_below_ephemeral(self.sock)
            self.sock.listen(64)
        except OSError:
            self.sock.close()
            raise
        self.port = int(self.sock.getsockname()[1])
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=_drain, args=(conn,), daemon=True).start()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _drain(conn: socket.socket) -> None:
    with conn:
        conn.settimeout(10)
        try:
            while conn.recv(64):
                pass
        except OSError:
            pass


def port_problem(addr: str, port: int) -> str | None:
    """Why an explicitly given master port cannot be used on this host, or None."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # TCPStore binds with SO_REUSEADDR too: TIME_WAIT leftovers are fine.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"--master_port {port} is already in use on {addr}"
            if exc.errno != errno.EADDRNOTAVAIL:  # not an address of this host
                return f"cannot bind {host_port(addr, port)}: {exc.strerror}"
    return None


def master_addr_problem(addr: str) -> str | None:
    """Why ``--master_addr addr`` cannot be the rendezvous held on this host,
    or None. The master's port is held here and the ranks connect to
    ``addr``: a name that does not resolve, or an address that is not this
    host's, would leave every rank waiting in ``init_process_group`` until
    its timeout. One resolved address that this host can bind is enough."""
    try:
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return f"--master_addr {addr!r} does not resolve ({reason})"
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as s:
            try:
                s.bind((sockaddr[0], 0, *sockaddr[2:]))
                return None
            except OSError:
                continue
    found = ", ".join(dict.fromkeys(str(info[4][0]) for info in infos))
    resolved = "" if found == addr else f" ({found})"
    return (f"--master_addr {addr!r}{resolved} is not an address of {socket.gethostname()}, "
            f"the host that holds the rendezvous (the first host of the job); the ranks "
            f"would wait for it until they time out: give one of its addresses, or leave "
            f"--master_addr out")


def check_reach(addr: str, port: int, timeout: float) -> str | None:
    """None if a TCP connection to addr:port succeeds, else why not."""
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return None
    except socket.timeout:
        return f"no answer from {host_port(addr, port)} within {timeout:g}s"
    except OSError as exc:
        return f"cannot connect to {host_port(addr, port)}: {exc.strerror or exc}"


def python_version() -> str:
    """As platform.python_version() gives it, without importing platform."""
    return ".".join(map(str, sys.version_info[:3]))


def package_version(name: str) -> str | None:
    # Imported here: importlib.metadata is a fifth of the agent's import time.
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------
# the agent's side of the probe phase


def probe_reply(msg: Mapping[str, Any]) -> tuple[dict[str, Any], HeldPort | None]:
    """Answer a ``probe`` command: this host's facts, and a held port (master)."""
    from dsrun import DSRUN_VERSION
    from dsrun.launcher.devices import usable_cpu_list, visible_devices

    cpu_list = usable_cpu_list()
    facts: dict[str, Any] = {
        "ev": "facts", "host": socket.gethostname(), "pid": os.getpid(),
        "executable": sys.executable, "devices": list(visible_devices()),
        "cpus": len(cpu_list), "cpu_list": list(cpu_list), "cwd": os.getcwd(),
    }
    if msg.get("versions", True):
        facts.update(python=python_version(), dsrun=DSRUN_VERSION,
                     torch=package_version("torch"))
    facts["machine"] = machine_identity()
    if msg.get("script"):
        facts["script"] = script_problem(str(msg["script"]))
    held = None
    role = msg.get("role")
    if role == "master":
        held = _probe_master(msg, facts)
    elif role == "worker":
        _probe_worker(msg, facts)
    return facts, held


def _probe_master(msg: Mapping[str, Any], facts: dict[str, Any]) -> HeldPort | None:
    addr = msg.get("addr")
    if not addr:
        if msg.get("single"):
            addr = LOCAL_MASTER
        else:
            sources = [route_source(p) for p in msg.get("peers", [])]
            addr = choose_master_addr(sources, hostname_addresses())
    master: dict[str, Any] = {"addr": addr, "port": msg.get("port"), "error": None}
    facts["master"] = master
    if msg.get("addr"):
        master["error"] = master_addr_problem(str(addr))
        if master["error"]:
            return None
    if addr and not msg.get("single"):
        facts["ifname"] = route_interface(addr)
    try:
        held = HeldPort(msg.get("port"), addr)
    except OSError as exc:
        master["error"] = f"port {msg.get('port')} is not free: {exc.strerror or exc}"
        return None
    master["port"] = held.port
    return held


def _probe_worker(msg: Mapping[str, Any], facts: dict[str, Any]) -> None:
    addr, port = str(msg["addr"]), int(msg["port"])
    facts["ifname"] = route_interface(addr)
    start = time.monotonic()
    facts["reach"] = {"error": check_reach(addr, port, float(msg.get("timeout", 5.0))),
                      "seconds": round(time.monotonic() - start, 3)}


def machine_identity() -> str:
    """Who this machine is, for finding one host listed twice (by name and
    by address): the kernel's boot id (one per booted machine) and the host
    name (which hosts sharing a kernel, like containers, do not share)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{boot}/{socket.gethostname()}"


def script_problem(path: str) -> str | None:
    """Why ``python PATH`` cannot run here (relative to the working
    directory, which the ranks share), or None."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "__main__.py")):
            return None
        return "is a directory without a __main__.py"
    return None if os.path.exists(path) else "does not exist"
