"""Which host is local, master address and interface choice (pure), and the
agent's probe answers (over loopback only)."""

from __future__ import annotations

import socket

import pytest

from dsrun.errors import DsrunUsageError
from dsrun.launcher import netinfo
from dsrun.launcher.netinfo import choose_master_addr, interface_for, is_local_host
from dsrun.launcher.plan import host_slots, socket_env

ADDRS = ["127.0.0.1", "10.0.0.5", "fe80::1%eth0", "::1"]


@pytest.mark.parametrize("host,resolved,expected", [
    ("localhost", None, True),
    ("LOCALHOST", None, True),
    ("127.0.0.1", None, True),
    ("127.0.1.1", None, True),  # all of 127/8 is this host
    ("::1", None, True),
    ("0::1", None, True),
    ("node1", None, True),  # own hostname
    ("Node1", None, True),
    ("node1.cluster", None, True),  # fully qualified form of the own short name
    ("node1.other", "10.9.9.9", True),  # same first label: same host
    ("10.0.0.5", None, True),  # own address
    ("node2", None, False),
    ("node10", None, False),
    ("10.0.0.6", None, False),
    ("gpu-a", "10.0.0.5", True),  # ssh_config HostName is an own address
    ("gpu-a", "127.0.0.1", True),
    ("gpu-a", "gpu-a.example", False),
])
def test_is_local_host(host, resolved, expected):
    assert is_local_host(host, "node1", ADDRS, resolved) is expected


def test_is_local_host_with_fqdn_hostname():
    assert is_local_host("node1", "node1.cluster.local", ADDRS)
    assert not is_local_host("node1.other", "node1.cluster.local", ADDRS)


@pytest.mark.parametrize("sources,by_name,expected", [
    (["10.0.0.5"], ["127.0.1.1"], "10.0.0.5"),  # the route to a peer wins
    ([None, "10.0.0.7"], [], "10.0.0.7"),
    (["127.0.0.1"], ["127.0.1.1", "10.0.0.5"], "10.0.0.5"),  # loopback never
    ([], ["fd00::2"], "fd00::2"),
    ([None], ["127.0.1.1"], None),
])
def test_choose_master_addr(sources, by_name, expected):
    assert choose_master_addr(sources, by_name) == expected


def test_interface_for_matches_by_address():
    ifs = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.0.0.5", "fe80::1%eth0"],
           "ib0": ["192.168.1.5"]}
    assert interface_for("10.0.0.5", ifs) == "eth0"
    assert interface_for("192.168.1.5", ifs) == "ib0"
    assert interface_for("fe80::1", ifs) == "eth0"
    assert interface_for("127.0.0.1", ifs) is None  # never bind gloo to loopback
    assert interface_for("10.9.9.9", ifs) is None
    assert interface_for("not-an-address", ifs) is None


def test_socket_env_respects_user_settings():
    assert socket_env("eth0", []) == {"GLOO_SOCKET_IFNAME": "eth0",
                                      "NCCL_SOCKET_IFNAME": "eth0"}
    assert socket_env("eth0", ["NCCL_SOCKET_IFNAME"]) == {"GLOO_SOCKET_IFNAME": "eth0"}
    assert socket_env(None, []) == {}


def test_host_slots_gpu_cpu_and_unknown():
    gpu = host_slots("a", (1, 2), False, (4, 5, 6))  # slot i = the host's i-th device
    assert (gpu.slots, gpu.gpus) == ((5, 6), True)
    cpu = host_slots("a", (0, 1, 2), False, ())
    assert (cpu.slots, cpu.gpus) == ((0, 1, 2), False)
    assert host_slots("a", (0,), False, None).gpus is None
    with pytest.raises(DsrunUsageError, match="host a has 2 GPU\\(s\\) but slot\\(s\\) 2,3"):
        host_slots("a", (0, 2, 3), False, (0, 1))


def test_probe_master_holds_a_port_that_a_worker_reaches():
    facts, held = netinfo.probe_reply({"cmd": "probe", "role": "master", "single": True,
                                       "peers": []})
    try:
        assert held is not None
        master = facts["master"]
        assert master == {"addr": "127.0.0.1", "port": held.port, "error": None}
        assert facts["ev"] == "facts" and facts["host"] == socket.gethostname()
        assert facts["cpus"] >= 1 and isinstance(facts["devices"], list)
        # taken while held
        again, none = netinfo.probe_reply({"cmd": "probe", "role": "master", "single": True,
                                           "port": held.port})
        assert none is None and "is not free" in again["master"]["error"]
        worker, _ = netinfo.probe_reply({"cmd": "probe", "role": "worker",
                                         "addr": "127.0.0.1", "port": held.port})
        assert worker["reach"]["error"] is None
    finally:
        held.close()
    worker, _ = netinfo.probe_reply({"cmd": "probe", "role": "worker", "addr": "127.0.0.1",
                                     "port": held.port, "timeout": 2})
    assert "cannot connect to 127.0.0.1" in worker["reach"]["error"]


def test_master_addr_must_be_an_address_of_the_master_host(monkeypatch):
    """A --master_addr that is not this host's would leave the ranks waiting
    for a rendezvous that nobody holds, until their timeout."""
    assert netinfo.master_addr_problem("127.0.0.1") is None
    assert netinfo.master_addr_problem("localhost") is None
    problem = netinfo.master_addr_problem("192.0.2.1")  # TEST-NET-1: nobody's address
    assert problem is not None and problem.startswith(
        f"--master_addr '192.0.2.1' is not an address of {socket.gethostname()}, the host "
        f"that holds the rendezvous")

    def no_such_name(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_such_name)
    assert netinfo.master_addr_problem("nosuchhost") == \
        "--master_addr 'nosuchhost' does not resolve (Name or service not known)"


def test_the_master_agent_checks_an_explicit_master_addr():
    facts, held = netinfo.probe_reply({"cmd": "probe", "role": "master", "single": False,
                                       "addr": "192.0.2.1", "peers": []})
    assert held is None
    assert "is not an address of" in facts["master"]["error"]


def test_probe_says_who_the_machine_is_and_whether_the_script_is_there(tmp_path,
                                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    (tmp_path / "pkg").mkdir()
    facts, _ = netinfo.probe_reply({"cmd": "probe", "role": None, "versions": False,
                                    "script": "train.py"})
    assert facts["script"] is None and socket.gethostname() in facts["machine"]
    missing, _ = netinfo.probe_reply({"cmd": "probe", "role": None, "versions": False,
                                      "script": "sub/train.py"})
    assert missing["script"] == "does not exist"
    assert missing["machine"] == facts["machine"]
    bare, _ = netinfo.probe_reply({"cmd": "probe", "role": None, "versions": False,
                                   "script": "pkg"})
    assert bare["script"] == "is a directory without a __main__.py"
    plain, _ = netinfo.probe_reply({"cmd": "probe", "role": None, "versions": False})
    assert "script" not in plain


def test_a_chosen_master_port_lies_below_the_ephemeral_range(tmp_path) -> None:
    """Ports the kernel hands out for outgoing connections never collide
    with it between the agent's check and rank 0's bind."""
    low, high = netinfo.ephemeral_range()
    held = [netinfo.HeldPort(None, "127.0.0.1") for _ in range(5)]
    try:
        ports = [h.port for h in held]
    finally:
        for h in held:
            h.close()
    if low - netinfo.PORT_FLOOR > 1000:
        assert all(netinfo.PORT_FLOOR <= p < low for p in ports), (ports, low)
    assert len(set(ports)) == 5
    fake = tmp_path / "range"
    fake.write_text("1024\t65000\n")
    assert netinfo.ephemeral_range(str(fake)) == (1024, 65000)
    assert netinfo.ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)
