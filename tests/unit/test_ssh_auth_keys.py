"""Which keys connect() offers (ssh_auth.key_plan), against a paramiko SSH
server on 127.0.0.1: an ssh-agent that does not answer, and IdentitiesOnly
without IdentityFile (the default ~/.ssh/id_* files)."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest

from dsrun.launcher.backends.ssh_auth import key_plan
from dsrun.launcher.backends.ssh_connect import SshConnectError, connect, resolve_target
from dsrun.launcher.spec import SshOptions
from tests.unit.test_ssh_connect_live import CLIENT_KEY, HOST_KEY, SshServer, _line


@pytest.fixture
def server() -> Iterator[SshServer]:
    srv = SshServer(CLIENT_KEY.asbytes())
    yield srv
    srv.close()


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    (tmp_path / ".ssh").mkdir()
    return tmp_path


class _BadAgent:
    """A Unix socket at SSH_AUTH_SOCK that hangs up on every client
    (``answer=False``: that never answers)."""

    def __init__(self, path: str, hang_up: bool) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(8)
        self.hang_up = hang_up
        self.held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if self.hang_up:
                conn.close()
            else:
                self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.fixture(params=["hangs up", "silent"])
def bad_agent(request, home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    path = str(home / "agent.sock")
    agent = _BadAgent(path, request.param == "hangs up")
    monkeypatch.setenv("SSH_AUTH_SOCK", path)
    yield request.param
    agent.close()


def _target(home: Path, port: int, **config):
    (home / "kh").write_text(_line(f"[127.0.0.1]:{port}", HOST_KEY))
    settings = {"hostname": "127.0.0.1", "port": str(port), "user": "me",
                "userknownhostsfile": str(home / "kh"), "globalknownhostsfile": "/dev/null",
                **config}
    return resolve_target("n1", SshOptions(timeout=1), settings, "me")


def test_an_agent_that_does_not_answer_is_skipped_with_a_warning(bad_agent, server, home,
                                                                caplog):
    """paramiko.Agent() raised ConnectionResetError / "lost ssh-agent" out of
    connect() (not an SshConnectError: the whole launch stopped), and an
    agent that never answered hung every connection."""
    CLIENT_KEY.write_private_key_file(str(home / ".ssh" / "id_ecdsa"))
    with caplog.at_level(logging.WARNING):
        client = connect(_target(home, server.port))
    client.close()
    assert "login me" in server.log
    assert any(f"n1: ssh-agent at SSH_AUTH_SOCK={home / 'agent.sock'} did not answer"
               in r.getMessage() for r in caplog.records), caplog.records


def test_an_agent_that_does_not_answer_is_named_when_no_key_works(bad_agent, server, home):
    with pytest.raises(SshConnectError) as info:
        connect(_target(home, server.port))
    message = str(info.value)
    assert "no ssh key to log in as me@127.0.0.1" in message
    assert f"ssh-agent at SSH_AUTH_SOCK={home / 'agent.sock'} did not answer" in message
    if bad_agent == "silent":
        assert "(no answer)" in message


def test_identities_only_without_identity_file_uses_the_default_files(server, home):
    """ssh_config(5): IdentitiesOnly uses the configured identities, "either
    the default files, or those explicitly configured"; dsrun offered none."""
    default = home / ".ssh" / "id_ecdsa"
    CLIENT_KEY.write_private_key_file(str(default))
    target = _target(home, server.port, identitiesonly="yes")
    assert key_plan(target).tried == [str(default)]
    client = connect(target)
    client.close()
    assert "login me" in server.log
    default.unlink()
    with pytest.raises(SshConnectError, match=r"looked at: ~/.ssh/id_rsa, ~/.ssh/id_ecdsa, "
                                              r"~/.ssh/id_ed25519 \(none exist\)"):
        connect(target)


def test_an_encrypted_pem_key_without_pub_does_not_claim_the_agent_lacks_it(home):
    """Without KEY.pub dsrun cannot tell whether the agent holds a PEM key."""
    key = home / "id_locked"
    paramiko.ECDSAKey.generate().write_private_key_file(str(key), password="secret")

    class _Agent(paramiko.Agent):
        def __init__(self) -> None:
            paramiko.agent.AgentSSH.__init__(self)

    target = resolve_target("n1", SshOptions(key=str(key)), {}, "me")
    plan = key_plan(target, agent_factory=_Agent)
    assert plan.tried == [f"{key} (encrypted, and no {key}.pub to match ssh-agent's keys "
                          f"against: load it with `ssh-add {key}`)"]


def test_an_identity_file_keeps_the_default_files_out(server, home):
    """OpenSSH adds the default ~/.ssh/id_* files only when no identity file
    is configured; dsrun offered them after IdentityFile's key too (a
    server counting failed keys could refuse the login before the right one)."""
    default = home / ".ssh" / "id_ecdsa"
    CLIENT_KEY.write_private_key_file(str(default))  # the one the server takes
    named = home / "id_named"
    paramiko.ECDSAKey.generate().write_private_key_file(str(named))
    target = _target(home, server.port, identityfile=[str(named)])
    assert not target.identities_only
    assert key_plan(target).tried == [str(named), "no ssh-agent (SSH_AUTH_SOCK is not set)"]
    with pytest.raises(SshConnectError, match=r"authentication as me@127.0.0.1:\d+ failed"):
        connect(target)
    flagged = resolve_target("n1", SshOptions(key=str(named)), {}, "me")
    assert key_plan(flagged).tried == [str(named)]


def test_without_identity_file_the_default_files_are_offered_after_the_agent(server, home):
    default = home / ".ssh" / "id_ecdsa"
    CLIENT_KEY.write_private_key_file(str(default))
    target = _target(home, server.port)
    assert key_plan(target).tried == ["no ssh-agent (SSH_AUTH_SOCK is not set)", str(default)]
    connect(target).close()
    assert "login me" in server.log
