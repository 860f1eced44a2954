"""Finding the master of a job that did not say where it is.

A rank started by ``mpirun`` or ``srun`` directly (not by dsrun's agents)
knows its rank and the world size from its launcher (env.py) but not
``MASTER_ADDR``/``MASTER_PORT``:

- MPI (:func:`mpi_store`): every rank tells the others its host name over
  mpi4py; rank 0 opens the TCPStore itself on a port the kernel picks (no
  fixed port, no bind-and-release race), chooses its address as the other
  hosts reach it (127.0.0.1 when the job is on one host; else the source
  address of its route to another rank's host, else a non-loopback address
  its name resolves to) and broadcasts both. Problems found on any rank are
  gathered first, so that every rank raises the same error rather than
  some waiting forever.
- Slurm (:func:`slurm_master`): the first node of the step and a port
  derived from the job and step ids (``MASTER_PORT`` wins).

A dsrun job (``DSRUN_JOB_ID`` set, master given by the launcher) opens its
store with :func:`job_store`, as torch's ``tcp://`` handler would (rank 0
hosts it, multi-tenant, libuv unless ``USE_LIBUV=0``), except that rank 0
writes the job id into it the moment it is bound, and every other rank
reads that id before it joins anything. The launcher's hold on the port
ends when the ranks start, and rank 0 binds it only once torch is
imported: another job given the same ``--master_port`` can take it in
between. Without the id, ranks of the two jobs would form one group and
kill both; with it, the job whose rank 0 did not get the port fails with
one error naming the port and the job that holds it. The store is kept
(:func:`current_store`): a rank's exit is posted there (exitmark.py), also
after the script destroyed its process group.

Multi-host jobs on gloo also check that this host's name does not resolve
to loopback (gloo would listen there, unreachable from other hosts) unless
``GLOO_SOCKET_IFNAME`` is set, and name the interface to set it to.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from dsrun.errors import DsrunError
from dsrun.launcher import netinfo
from dsrun.runtime.env import DistEnv, slurm_port

LOCAL_MASTER = "127.0.0.1"
DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


#: The key, in the job's raw store, that holds the id of the job whose rank 0 hosts it.
JOB_KEY = "dsrun/job_id"
#: Characters of a job id an error shows: as many as the launcher's banner
#: and ``dsrun stack`` show (control.ID_CHARS).
SHOWN_ID = 12
#: How long a rank waits for that key once connected: rank 0 sets it right after binding.
JOB_KEY_WAIT = datetime.timedelta(seconds=60)
#: How long rank 0 spends asking the port's holder who it is, after losing the port.
OWNER_WAIT = datetime.timedelta(seconds=3)
#: This process's dsrun job store once :func:`job_store` opened it (exitmark.py
#: posts a rank's exit there, even after the script destroyed its group).
_job_store: Any = None


def current_store() -> Any:
    """The dsrun job store this process opened, or None."""
    return _job_store


def mpi_comm() -> Any:
    """mpi4py's COMM_WORLD (initialising MPI), or a DsrunError saying why not."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise DsrunError(f"this rank was started by an MPI launcher without MASTER_ADDR/"
                         f"MASTER_PORT; finding them needs mpi4py ({exc}): pip install "
                         f"mpi4py, or set both variables") from None
    return MPI.COMM_WORLD


def master_address(hosts: Sequence[str], own: str, peers_route: str | None,
                   by_name: Sequence[str]) -> str | None:
    """Rank 0's address for the others (pure): loopback when every rank is
    on this host, else ``peers_route`` (the source address of the route to
    another rank's host), else a non-loopback address of its name."""
    if all(h == own for h in hosts):
        return LOCAL_MASTER
    return netinfo.choose_master_addr([peers_route], by_name)


def gloo_problem(backend: str, multi_host: bool, master: str,
                 environ: Mapping[str, str]) -> str | None:
    """Why gloo would bind an address other hosts cannot reach, or None."""
    if backend != "gloo" or not multi_host or environ.get("GLOO_SOCKET_IFNAME"):
        return None
    host = socket.gethostname()
    addrs = netinfo.hostname_addresses()
    if addrs and not all(netinfo.is_loopback(a) for a in addrs):
        return None
    iface = netinfo.route_interface(master) or "<the interface that reaches the master>"
    seen = addrs[0] if addrs else "nothing"
    return (f"{host}: its host name resolves to {seen}, so gloo would listen on an address "
            f"the other hosts cannot reach; set GLOO_SOCKET_IFNAME={iface} (the interface "
            f"that routes to the master {master})")


def _rank0_master(hosts: Sequence[str], port: int | None, world: int,
                  timeout: datetime.timedelta) -> tuple[Any, str | None, int, str | None]:
    import torch.distributed as dist

    own = socket.gethostname()
    other = next((h for h in hosts if h != own), None)
    route = netinfo.route_source(other) if other else None
    addr = master_address(hosts, own, route, netinfo.hostname_addresses())
    if addr is None:
        return None, None, 0, (f"cannot find an address of {own} (rank 0) that the other "
                               f"hosts reach; set MASTER_ADDR")
    try:
        store = dist.TCPStore(addr, port or 0, world, True, timeout=timeout,
                              wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        return None, addr, 0, f"rank 0 cannot open the rendezvous store on port {port}: {exc}"
    return store, addr, int(store.port), None


def mpi_store(env: DistEnv, backend: str, port: int | None = None,
              timeout: datetime.timedelta | None = None) -> tuple[Any, str, int]:
    """Open the job's TCPStore through MPI (see the module docstring).

    Returns (store, master address, port); raises the same DsrunError on
    every rank when any rank found a problem.
    """
    import torch.distributed as dist

    comm = mpi_comm()
    timeout = timeout or DEFAULT_TIMEOUT
    if comm.Get_size() != env.world_size:
        raise DsrunError(
            f"{env.source} says the world size is {env.world_size} but MPI's COMM_WORLD has "
            f"{comm.Get_size()} process(es): mpi4py is not using the MPI that started this "
            f"job (check `python -c 'from mpi4py import MPI; print(MPI.Get_library_version())'`"
            f" against `mpirun --version`)")
    hosts = comm.allgather(socket.gethostname())
    store, addr, got_port, error = None, None, 0, None
    if env.rank == 0:
        store, addr, got_port, error = _rank0_master(hosts, port, env.world_size, timeout)
    addr, got_port, error = comm.bcast((addr, got_port, error), root=0)
    if error is None:
        error = gloo_problem(backend, len(set(hosts)) > 1, addr, os.environ)
    errors = [e for e in comm.allgather(error) if e]
    if errors:
        raise DsrunError(errors[0])
    if store is None:
        store = dist.TCPStore(addr, got_port, env.world_size, False, timeout=timeout)
    return store, addr, got_port


def slurm_master(env: DistEnv, backend: str, port: int | None = None) -> tuple[str, int]:
    """MASTER_ADDR/PORT of a job step started by srun (see the module docstring)."""
    if not env.nodes:
        raise DsrunError("started by srun but SLURM_STEP_NODELIST is not set; set "
                         "MASTER_ADDR and MASTER_PORT")
    addr = env.master_addr or env.nodes[0]
    if port is None:
        port = env.master_port
    if port is None:
        if env.slurm_job is None:
            raise DsrunError("started by srun but SLURM_JOB_ID is not set; set MASTER_PORT")
        port = slurm_port(*env.slurm_job)
    problem = gloo_problem(backend, len(set(env.nodes)) > 1, addr, os.environ)
    if problem:
        raise DsrunError(problem)
    return addr, port


def job_store(env: DistEnv, timeout: datetime.timedelta) -> Any:
    """The TCPStore of a dsrun job at the launcher-given master (module
    docstring): rank 0 hosts it and writes the job id; the others connect
    and refuse a store that holds another job's id."""
    global _job_store
    import torch.distributed as dist

    assert env.master_addr is not None and env.master_port is not None and env.job_id
    addr, port = env.master_addr, env.master_port
    # what torch's tcp:// handler passes (_create_c10d_store, _get_use_libuv_from_query_dict)
    options = dict(timeout=timeout, multi_tenant=True,
                   use_libuv=os.environ.get("USE_LIBUV", "1") == "1")
    if env.rank == 0:
        try:
            # not waiting for workers: the id must be there before any of them reads it
            store = dist.TCPStore(addr, port, env.world_size, True, wait_for_workers=False,
                                  **options)
        except (RuntimeError, OSError) as exc:
            raise DsrunError(_bind_error(addr, port, str(exc))) from None
        store.set(JOB_KEY, env.job_id)
        _job_store = store
        return store
    store = dist.TCPStore(addr, port, env.world_size, False, **options)
    owner = _job_id_in(store, min(timeout, JOB_KEY_WAIT))
    if owner != env.job_id:
        raise DsrunError(_foreign_store_error(addr, port, env.job_id, owner))
    _job_store = store
    return store


def _job_id_in(store: Any, wait: datetime.timedelta) -> str | None:
    """The dsrun job id in ``store``, or None when none appears within ``wait``."""
    try:
        store.wait([JOB_KEY], wait)
        return bytes(store.get(JOB_KEY)).decode(errors="replace")
    except (RuntimeError, OSError):  # torch's DistStoreError (a RuntimeError): no such key
        return None


def _foreign_store_error(addr: str, port: int, job_id: str, owner: str | None) -> str:
    whose = f"dsrun job {owner[:SHOWN_ID]}" if owner else \
        "another program (its store holds no dsrun job id)"
    return (f"the rendezvous store on {netinfo.host_port(addr, port)} (MASTER_PORT) belongs "
            f"to {whose}, not to "
            f"this job ({job_id[:SHOWN_ID]}): the port was taken after dsrun checked it was "
            f"free, as when two jobs are given the same --master_port at once. This job stops "
            f"before joining it; give each job its own --master_port, or leave it out (dsrun "
            f"picks a free one)")


def _bind_error(addr: str, port: int, reason: str) -> str:
    if "EADDRINUSE" not in reason and "already in use" not in reason:
        return (f"rank 0 cannot open the job's rendezvous store on "
                f"{netinfo.host_port(addr, port)}: {reason}")
    owner = _port_owner(addr, port)
    whose = f"dsrun job {owner[:SHOWN_ID]}" if owner else "another program (or another dsrun job)"
    return (f"rank 0 cannot open the job's rendezvous store: port {port} on {addr} "
            f"(MASTER_PORT) was taken by {whose} after dsrun checked it was free, as when two "
            f"jobs are given the same --master_port at once; give each job its own "
            f"--master_port, or leave it out (dsrun picks a free one)")


def _port_owner(addr: str, port: int) -> str | None:
    """The id of the dsrun job whose store listens on ``addr:port``, if one
    answers within about twice :data:`OWNER_WAIT` (a client without a world
    size: the owner's count of its ranks is not touched)."""
    import torch.distributed as dist

    found: list[str | None] = []

    def ask() -> None:
        try:
            client = dist.TCPStore(addr, port, None, False, timeout=OWNER_WAIT,
                                   wait_for_workers=False)
        except (RuntimeError, OSError):
            return
        found.append(_job_id_in(client, OWNER_WAIT))

    # in a thread: a listener that is no store (a held port) accepts and
    # never answers, and TCPStore's handshake then waits without a limit;
    # this rank is about to exit with its error, which ends the thread
    asker = threading.Thread(target=ask, name="dsrun-port-owner", daemon=True)
    asker.start()
    asker.join(2 * OWNER_WAIT.total_seconds())
    return found[0] if found else None
