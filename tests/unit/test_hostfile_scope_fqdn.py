"""Hostfile hosts at the edges of the syntax: IPv6 scope ids and absolute
(trailing-dot) DNS names; ``hosts add`` never writes a file it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from dsrun.errors import HostfileError
from dsrun.launcher import hostfile as hf
from dsrun.launcher.hostfile import (
    add_host,
    host_key,
    host_problem,
    hostfile_problems,
    parse_hostfile,
    remove_host,
    set_slots,
)
from dsrun.launcher.hosts_cli import hosts
from dsrun.launcher.resources import select_resources

BASE = "w0 slots=1\nw1 slots=1\n"


@pytest.mark.parametrize("host", ["fe80::1%eth0", "fe80::1%3", "fe80::1%eth0.100",
                                  "fe80::1%enp0s31f6", "fe80::1%br-lan_2"])
def test_interface_names_and_numbers_are_scope_ids(host: str) -> None:
    assert host_problem(host) is None
    assert parse_hostfile(f"{host} slots=2\n", "hf").hosts == (host,)


@pytest.mark.parametrize("scope", ["eth0 ", " eth0", "x\nw1 slots=7", "x\tw", "a#b", "a%b",
                                   "a/b", "", "a\x00b", "a\x1bb", "a\rb", "ä"])
def test_a_scope_id_that_is_no_interface_name_is_refused(scope: str) -> None:
    host = f"fe80::1%{scope}"
    problem = host_problem(host)
    assert problem is not None and f"scope id {scope!r}" in problem
    assert "interface name or number" in problem


@pytest.mark.parametrize("host", ["fe80::1%eth0 ", "fe80::1%x\nw1 slots=7", "fe80::1%x#y"])
def test_hosts_add_refuses_a_bad_scope_and_leaves_the_file(host: str) -> None:
    with pytest.raises(HostfileError, match="scope id"):
        add_host(BASE, host, 1)


def test_hosts_add_cli_writes_no_file_it_refuses(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(hf, "DEFAULT_JOB_HOSTFILE", str(tmp_path / "job" / "hostfile"))
    (tmp_path / "hostfile").write_text(BASE)
    runner = CliRunner()
    assert runner.invoke(hosts, ["add", "fe80::1%eth0", "--slots", "1"]).exit_code == 0
    for bad in ("fe80::1%eth0 ", "fe80::1%x\nw1 slots=7"):
        res = runner.invoke(hosts, ["add", bad, "--slots", "1"])
        assert res.exit_code != 0, res.output
    text = (tmp_path / "hostfile").read_text()
    assert text == BASE + "fe80::1%eth0 slots=1\n"
    assert runner.invoke(hosts, ["validate"]).exit_code == 0


# Text an `add` may be handed: a host-like start, then pieces that matter to
# the hostfile's syntax (whitespace, '#', line breaks str.split knows).
_STARTS = st.sampled_from(["fe80::1%", "fe80::1%eth0", "fe80::1", "w1", "beta", "node."])
_PIECES = st.sampled_from(["eth0", "w1", ".", "a", "-", "_", ":", "1", "%", " ", "\t",
                           "\n", "\r", "#", "slots=2", "@", "]", "/", "\x0b", "\x0c",
                           "\x85", "\u2028", "\x00"])
_FILE = "w0 slots=1\nfe80::1%eth0 slots=1\n"


@settings(max_examples=600, deadline=None)
@given(st.tuples(_STARTS, st.lists(_PIECES, max_size=4).map("".join)).map("".join))
def test_whatever_add_accepts_reparses_clean(host: str) -> None:
    try:
        text = add_host(_FILE, host, 3)
    except HostfileError:
        return
    assert hostfile_problems(text, "hf") == [], (host, text)
    assert parse_hostfile(text, "hf").get(host) is not None


@pytest.mark.parametrize("host", ["node1.", "a.example.org.", "Node_1.Cluster."])
def test_absolute_names_are_hosts(host: str) -> None:
    assert host_problem(host) is None
    assert parse_hostfile(f"{host} slots=2\n", "hf").hosts == (host,)
    text = add_host(BASE, host, 2)
    assert text == f"{BASE}{host} slots=2\n"  # kept as written: ssh_config matches it so
    assert hostfile_problems(text, "hf") == []


@pytest.mark.parametrize("host", ["a..", ".", "..", ".a.", "a..b."])
def test_only_one_final_dot(host: str) -> None:
    assert host_problem(host) is not None


def test_the_final_dot_is_not_a_label_of_its_own() -> None:
    assert host_problem("a" * 63 + ".") is None
    assert host_problem(".".join(["a" * 63] * 3) + "." + "a" * 61 + ".") is None  # 253 + "."


def test_absolute_and_relative_spelling_are_one_host() -> None:
    assert host_key("beta.") == host_key("beta") == host_key("BETA.")
    problems = hostfile_problems("beta slots=1\nbeta. slots=2\n", "hf")
    assert [str(p) for p in problems] == \
        ["hf:2:1: duplicate host 'beta.' (already on line 1 as 'beta')"]
    with pytest.raises(HostfileError, match="already listed"):
        add_host("beta. slots=1\n", "beta", 1)
    with pytest.raises(HostfileError, match="already listed"):
        add_host("beta slots=1\n", "Beta.", 1)
    assert set_slots("w0 slots=1\nbeta. slots=1\n", "beta", 4) == "w0 slots=1\nbeta. slots=4\n"
    assert remove_host("w0 slots=1\nbeta. slots=1\n", "beta") == "w0 slots=1\n"


def test_include_selects_an_absolute_name_by_either_spelling() -> None:
    pool = parse_hostfile("alpha. slots=2\nbeta. slots=2\n", "hf")
    chosen = select_resources(pool, "beta:1", None, None, None)
    assert [(n.host, n.slots) for n in chosen] == [("beta.", (1,))]
    chosen = select_resources(pool, None, "alpha", None, None)
    assert [n.host for n in chosen] == ["beta."]
