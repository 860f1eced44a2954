"""Where a rank is, read from MPI and Slurm variables; the connect-back handshake."""

from __future__ import annotations

import socket
import threading

import pytest

from dsrun.errors import DsrunError
from dsrun.hostlist import expand_counts, expand_hostlist
from dsrun.launcher import callback
from dsrun.runtime.env import DistEnv, slurm_port
from dsrun.runtime.rendezvous import master_address


@pytest.mark.parametrize("text,hosts", [
    ("node[1-3,07]", ["node1", "node2", "node3", "node07"]),
    ("gpu[01-02]-ib,login", ["gpu01-ib", "gpu02-ib", "login"]),
    ("r[1-2]n[8-9]", ["r1n8", "r1n9", "r2n8", "r2n9"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("single", ["single"]), ("", []),
])
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["n[1-", "n]1[", "n[3-1]", "n[a]", "a,,b", "n[[1]]"])
def test_bad_hostlists_name_the_problem(text):
    with pytest.raises(ValueError, match="host list"):
        expand_hostlist(text)


def test_expand_counts():
    assert expand_counts("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ValueError, match="bad part"):
        expand_counts("2(x)")


def test_dsrun_variables_win_over_mpi_ones():
    env = DistEnv.detect({"RANK": "1", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0",
                          "OMPI_COMM_WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "5"})
    assert (env.rank, env.world_size, env.source, env.master_known) == \
        (1, 2, "dsrun/torchrun", True)


@pytest.mark.parametrize("variables,expected", [
    ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
      "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
     (3, 4, 1, 2, "Open MPI", "mpi")),
    ({"MV2_COMM_WORLD_RANK": "2", "MV2_COMM_WORLD_SIZE": "3",
      "MV2_COMM_WORLD_LOCAL_RANK": "0", "MV2_COMM_WORLD_LOCAL_SIZE": "1"},
     (2, 3, 0, 1, "MVAPICH", "mpi")),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
     (1, 2, 1, 2, "PMI", "mpi")),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_STEP_NUM_TASKS": "6",
      "SLURM_LOCALID": "0", "SLURM_NODEID": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2),1,1"},
     (5, 6, 0, 1, "Slurm", "slurm")),
])
def test_launcher_variables(variables, expected):
    env = DistEnv.detect(variables)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.source,
            env.rendezvous) == expected
    assert not env.master_known


def test_slurm_nodes_and_port():
    env = DistEnv.detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0",
                          "SLURM_STEP_NODELIST": "node[2-3]", "SLURM_JOB_ID": "41",
                          "SLURM_STEP_ID": "2", "SLURM_NTASKS_PER_NODE": "2"})
    assert env.nodes == ("node2", "node3") and env.slurm_job == (41, 2)
    assert env.local_world_size == 2
    ports = {slurm_port(41, s) for s in range(8)} | {slurm_port(42, 0)}
    assert len(ports) == 9 and all(20000 <= p < 40000 for p in ports)


def test_pmix_takes_the_size_from_mpi():
    env = DistEnv.detect({"PMIX_RANK": "2", "PMIX_LOCAL_RANK": "0", "PMIX_LOCAL_SIZE": "1"},
                         mpi_size=lambda: 3)
    assert (env.rank, env.world_size, env.source) == (2, 3, "PMIx")
    with pytest.raises(DsrunError, match="PMIX_RANK is set but not the world size"):
        DistEnv.detect({"PMIX_RANK": "0"})


def test_bad_values_name_the_variable():
    with pytest.raises(DsrunError, match="SLURM_NTASKS='x' is not an integer"):
        DistEnv.detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "x"})
    with pytest.raises(DsrunError, match="rank 4 outside world size 4 .from Open MPI"):
        DistEnv.detect({"OMPI_COMM_WORLD_RANK": "4", "OMPI_COMM_WORLD_SIZE": "4"})


def test_master_address_choice():
    assert master_address(["a", "a"], "a", "10.0.0.1", []) == "127.0.0.1"
    assert master_address(["a", "b"], "a", "10.0.0.1", ["127.0.1.1"]) == "10.0.0.1"
    assert master_address(["a", "b"], "a", None, ["127.0.1.1", "192.168.1.4"]) == \
        "192.168.1.4"
    assert master_address(["a", "b"], "a", None, ["127.0.1.1"]) is None


def test_variables_init_distributed_exports_after_discovering_the_rank():
    """DeepSpeed's MPI discovery exports RANK, LOCAL_RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT; so does dsrun's, when it placed
    the rank from MPI or Slurm itself (never under dsrun/torchrun)."""
    from dsrun.runtime.dist import DISCOVERED, discovered_variables

    ompi = DistEnv.detect({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
                           "OMPI_COMM_WORLD_LOCAL_RANK": "1"})
    ompi = DistEnv.detect({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
                           "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    got = discovered_variables(ompi, 3, 4, ("10.0.0.1", 41000))
    assert got == {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "41000"}
    assert tuple(got) == DISCOVERED
    # read again after the export, the rank is placed the same way
    again = DistEnv.detect(got)
    assert (again.rank, again.local_rank, again.world_size, again.local_world_size) == \
        (ompi.rank, ompi.local_rank, ompi.world_size, ompi.local_world_size)
    slurm = DistEnv.detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert discovered_variables(slurm, 0, 1, None) == {"RANK": "0", "LOCAL_RANK": "0",
                                                       "WORLD_SIZE": "1",
                                                       "LOCAL_WORLD_SIZE": "1"}
    torchrun = DistEnv.detect({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h",
                               "MASTER_PORT": "5"})
    assert discovered_variables(torchrun, 1, 2, ("h", 5)) == {}
    assert discovered_variables(DistEnv.detect({}), 0, 1, None) == {}


# -- the connect-back handshake -------------------------------------------------------


def test_endpoints_and_identity():
    text = callback.format_endpoints(["10.0.0.1", "fe80::1"], 5)
    assert text == "10.0.0.1:5 [fe80::1]:5"
    assert callback.parse_endpoints(text) == [("10.0.0.1", 5), ("fe80::1", 5)]
    with pytest.raises(ValueError, match="bad launcher address"):
        callback.parse_endpoints("10.0.0.1")
    assert callback.identity({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}) \
        == callback.Identity(3, 1, "Open MPI")
    assert callback.identity({"SLURM_PROCID": "2", "SLURM_LOCALID": "0"}).source == "Slurm"
    with pytest.raises(ValueError, match="must be started by mpirun or srun"):
        callback.identity({})


def _serve(secret: str, result: dict) -> tuple[socket.socket, threading.Thread]:
    server = socket.create_server(("127.0.0.1", 0))

    def accept() -> None:
        conn, _ = server.accept()
        try:
            result["hello"] = callback.server_handshake(conn, secret, timeout=5)
        except callback.HandshakeError as exc:
            result["error"] = str(exc)
        finally:
            conn.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    return server, thread


@pytest.mark.parametrize("agent_secret,ok", [("s" * 64, True), ("t" * 64, False)])
def test_handshake_proves_the_secret_without_sending_it(agent_secret, ok):
    result: dict = {}
    server, thread = _serve("s" * 64, result)
    port = server.getsockname()[1]
    env = {"DSRUN_LAUNCHER": f"127.0.0.1:{port}", "DSRUN_LAUNCHER_SECRET": agent_secret,
           "DSRUN_LAUNCHER_TIMEOUT": "5"}
    try:
        if ok:
            callback.agent_connect(env, callback.Identity(2, 0, "Slurm")).close()
        else:
            with pytest.raises(callback.HandshakeError):
                callback.agent_connect(env, callback.Identity(2, 0, "Slurm"))
        thread.join(5)
    finally:
        server.close()
    if ok:
        assert result["hello"]["rank"] == 2 and result["hello"]["source"] == "Slurm"
        assert "s" * 64 not in str(result["hello"])
    else:
        assert result["error"] == "wrong proof of the job secret"
