"""connect() against a paramiko SSH server on 127.0.0.1 (a thread of this
process): known_hosts files with marker and malformed lines, a port-less
entry for a non-22 port, StrictHostKeyChecking no with a changed key, an
encrypted key that ssh-agent holds, no key at all, ProxyCommand and
ProxyJump (direct-tcpip through the same server)."""

from __future__ import annotations

import logging
import os
import select
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest

from dsrun.launcher.backends.ssh_connect import SshConnectError, connect, resolve_target
from dsrun.launcher.spec import SshOptions

HOST_KEY = paramiko.ECDSAKey.generate()
CLIENT_KEY = paramiko.ECDSAKey.generate()
OTHER_KEY = paramiko.ECDSAKey.generate()


def _line(names: str, key: paramiko.PKey, marker: str = "") -> str:
    return f"{marker}{' ' if marker else ''}{names} {key.get_name()} {key.get_base64()}\n"


class _Server(paramiko.ServerInterface):
    def __init__(self, allowed: bytes, log: list[str],
                 destinations: dict[int, tuple[str, int]]) -> None:
        self.allowed, self.log, self.destinations = allowed, log, destinations

    def get_allowed_auths(self, username: str) -> str:
        return "publickey"

    def check_auth_publickey(self, username: str, key: paramiko.PKey) -> int:
        if key.asbytes() == self.allowed:
            self.log.append(f"login {username}")
            return paramiko.AUTH_SUCCESSFUL
        return paramiko.AUTH_FAILED

    def check_channel_request(self, kind: str, chanid: int) -> int:
        return paramiko.OPEN_SUCCEEDED

    def check_channel_direct_tcpip_request(self, chanid, origin, destination) -> int:
        self.log.append(f"direct-tcpip {destination[0]}:{destination[1]}")
        self.destinations[chanid] = destination
        return paramiko.OPEN_SUCCEEDED


class SshServer:
    """Accepts connections until closed; relays direct-tcpip channels."""

    def __init__(self, allowed: bytes) -> None:
        self.allowed = allowed
        self.log: list[str] = []
        self.destinations: dict[int, tuple[str, int]] = {}
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.transports: list[paramiko.Transport] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        transport = paramiko.Transport(conn)
        self.transports.append(transport)
        transport.add_server_key(HOST_KEY)
        try:
            transport.start_server(server=_Server(self.allowed, self.log, self.destinations))
        except (paramiko.SSHException, EOFError, OSError):
            return
        while transport.is_active():
            chan = transport.accept(0.2)
            destination = self.destinations.get(chan.get_id()) if chan else None
            if destination is not None:
                threading.Thread(target=_relay, args=(chan, destination), daemon=True).start()

    def close(self) -> None:
        self.listener.close()
        for transport in self.transports:
            transport.close()


def _relay(chan: paramiko.Channel, destination: tuple[str, int]) -> None:
    try:
        _pump(chan, destination)
    except (OSError, EOFError, paramiko.SSHException):
        pass  # the client closed the jump connection first


def _pump(chan: paramiko.Channel, destination: tuple[str, int]) -> None:
    with socket.create_connection(destination) as sock:
        while True:
            ready, _, _ = select.select([chan, sock], [], [], 5)
            if not ready:
                continue
            if chan in ready:
                data = chan.recv(65536)
                if not data:
                    break
                sock.sendall(data)
            if sock in ready:
                data = sock.recv(65536)
                if not data:
                    break
                chan.sendall(data)
    chan.close()


@pytest.fixture
def server() -> Iterator[SshServer]:
    srv = SshServer(CLIENT_KEY.asbytes())
    yield srv
    srv.close()


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HOME and no ssh-agent: only what a test writes is used."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    key = tmp_path / "id_client"
    CLIENT_KEY.write_private_key_file(str(key))
    return tmp_path


def _target(home: Path, port: int, known: str, **config: str):
    (home / "kh").write_text(known)
    settings = {"hostname": "127.0.0.1", "port": str(port), "user": "me",
                "identityfile": [str(home / "id_client")], "identitiesonly": "yes",
                "userknownhostsfile": str(home / "kh"), "globalknownhostsfile": "/dev/null",
                **config}
    return resolve_target("n1", SshOptions(timeout=5), settings, "me")


def _connects(target) -> None:
    client = connect(target)
    client.close()


def test_marker_and_malformed_lines_do_not_break_other_hosts(server, home, caplog):
    """One @cert-authority or @revoked line (for other hosts) made every
    host fail with paramiko's raw ('line', Error('Incorrect padding'))."""
    known = (_line("*.example.org", OTHER_KEY, "@cert-authority")
             + _line("*", OTHER_KEY, "@revoked")
             + "bad-line ssh-ed25519 AAAA-not-base64\n"
             + _line(f"[127.0.0.1]:{server.port}", HOST_KEY))
    with caplog.at_level(logging.WARNING):
        _connects(_target(home, server.port, known))
    err = caplog.text
    assert f"known_hosts {home / 'kh'}:3: the ssh-ed25519 key is not valid base64; " \
           "line skipped" in err


def test_a_revoked_host_key_is_refused(server, home):
    known = _line("*", HOST_KEY, "@revoked") + _line(f"[127.0.0.1]:{server.port}", HOST_KEY)
    with pytest.raises(SshConnectError, match=rf"is marked @revoked in {home / 'kh'}:1"):
        _connects(_target(home, server.port, known))


def test_a_host_known_only_through_a_ca_says_so(server, home):
    known = _line("127.0.0.1", OTHER_KEY, "@cert-authority")
    with pytest.raises(SshConnectError) as info:
        _connects(_target(home, server.port, known))
    message = str(info.value)
    assert f"{home / 'kh'}:1 trusts a host certificate authority" in message
    assert f"ssh-keyscan -H -p {server.port} 127.0.0.1" in message
    assert "--ssh_insecure" in message


def test_a_non_default_port_falls_back_to_the_portless_entry(server, home):
    """ssh accepts `ssh -p 2222 host` when only `host KEY` is known."""
    _connects(_target(home, server.port, _line("127.0.0.1", HOST_KEY)))
    with pytest.raises(SshConnectError) as info:
        _connects(_target(home, server.port, _line("127.0.0.1", OTHER_KEY)))
    assert f"is not in known_hosts for port {server.port} and does NOT match the " \
           f"port-less entry {home / 'kh'}:1" in str(info.value)
    assert f"ssh-keyscan -H -p {server.port} 127.0.0.1" in str(info.value)


def test_strict_no_warns_about_a_changed_key_then_connects(server, home, caplog):
    known = _line(f"[127.0.0.1]:{server.port}", OTHER_KEY)
    with caplog.at_level(logging.WARNING):
        _connects(_target(home, server.port, known, stricthostkeychecking="no"))
    err = "\n".join(r.getMessage() for r in caplog.records)
    assert len(caplog.records) == 1, err
    assert f"n1: host key of 127.0.0.1:{server.port} does NOT match known_hosts " \
           f"({home / 'kh'}:1); connecting anyway (StrictHostKeyChecking no)" in err


def test_host_key_alias_is_the_lookup_name(server, home):
    _connects(_target(home, server.port, _line("my-alias", HOST_KEY),
                      hostkeyalias="my-alias"))


def test_no_key_at_all_says_what_was_tried(server, home):
    (home / "kh").write_text(_line(f"[127.0.0.1]:{server.port}", HOST_KEY))
    target = resolve_target("n1", SshOptions(timeout=5), {
        "hostname": "127.0.0.1", "port": str(server.port), "user": "me",
        "userknownhostsfile": str(home / "kh")}, "me")
    with pytest.raises(SshConnectError) as info:
        _connects(target)
    message = str(info.value)
    assert "no ssh key to log in as me@127.0.0.1" in message
    assert "SSH_AUTH_SOCK is not set" in message and "--ssh_key" in message
    assert "No authentication methods available" not in message


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if shutil.which("ssh-agent") is None or shutil.which("ssh-keygen") is None:
        pytest.skip("ssh-agent/ssh-keygen not installed")
    sock = str(tmp_path / "agent.sock")
    proc = subprocess.Popen(["ssh-agent", "-D", "-a", sock], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            if os.path.exists(sock) or proc.poll() is not None:
                break
            threading.Event().wait(0.05)
        if not os.path.exists(sock):
            pytest.fail(f"ssh-agent did not start (status {proc.poll()})")
        monkeypatch.setenv("SSH_AUTH_SOCK", sock)
        yield sock
    finally:
        proc.terminate()
        proc.wait(5)


@pytest.mark.parametrize("how", ["identitiesonly", "ssh_key"])
def test_an_encrypted_key_held_by_ssh_agent_is_used(how, agent, tmp_path, monkeypatch):
    """IdentitiesOnly yes (or --ssh_key) with an encrypted key: ssh uses the
    agent's copy; dsrun said "the ssh key is encrypted"."""
    monkeypatch.setenv("HOME", str(tmp_path))
    key = tmp_path / "id_enc"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["ssh-add", "-q", str(key)], check=True, stderr=subprocess.DEVNULL,
                   env={**os.environ, "SSH_AUTH_SOCK": agent})
    subprocess.run(["ssh-keygen", "-q", "-p", "-P", "", "-N", "secret", "-f", str(key)],
                   check=True, stdout=subprocess.DEVNULL)
    public = paramiko.PublicBlob.from_file(f"{key}.pub").key_blob
    os.unlink(f"{key}.pub")  # its public half comes from the key file itself
    srv = SshServer(public)
    try:
        (tmp_path / "kh").write_text(_line(f"[127.0.0.1]:{srv.port}", HOST_KEY))
        config = {"hostname": "127.0.0.1", "port": str(srv.port),
                  "userknownhostsfile": str(tmp_path / "kh")}
        if how == "identitiesonly":
            config.update(identityfile=[str(key)], identitiesonly="yes")
            options = SshOptions(timeout=5)
        else:
            options = SshOptions(timeout=5, key=str(key))
        _connects(resolve_target("n1", options, config, "me"))
        assert "login me" in srv.log
    finally:
        srv.close()


def test_proxy_command_with_tokens(server, home):
    relay = home / "relay.py"
    relay.write_text(
        "import socket, sys, threading\n"
        "s = socket.create_connection((sys.argv[1], int(sys.argv[2])))\n"
        "def up():\n"
        "    for b in iter(lambda: sys.stdin.buffer.raw.read(65536), b''):\n"
        "        s.sendall(b)\n"
        "    s.shutdown(socket.SHUT_WR)\n"
        "threading.Thread(target=up, daemon=True).start()\n"
        "open(sys.argv[-1], 'w').write(' '.join(sys.argv[1:-1]))\n"
        "for b in iter(lambda: s.recv(65536), b''):\n"
        "    sys.stdout.buffer.write(b); sys.stdout.flush()\n")
    command = f"{sys.executable} {relay} %h %p %r %n %% {home / 'seen'}"
    _connects(_target(home, server.port, _line(f"[127.0.0.1]:{server.port}", HOST_KEY),
                      proxycommand=command))
    assert "login me" in server.log
    assert (home / "seen").read_text() == f"127.0.0.1 {server.port} me n1 %"
    failing = _target(home, server.port, _line(f"[127.0.0.1]:{server.port}", HOST_KEY),
                      proxycommand="sh -c 'echo proxy says no >&2; exit 3'")
    with pytest.raises(SshConnectError,
                       match=r"n1: ProxyCommand .* exited with status 3: proxy says no"):
        _connects(failing)


def test_proxy_jump_opens_a_direct_tcpip_channel(server, home):
    """The target (the same server, as seen from the jump host) is reached
    over a direct-tcpip channel of the jump host's connection."""
    known = _line(f"[127.0.0.1]:{server.port}", HOST_KEY)
    (home / "kh").write_text(known)
    jump_config = {"hostname": "127.0.0.1", "port": str(server.port), "user": "hop",
                   "identityfile": [str(home / "id_client")], "identitiesonly": "yes",
                   "userknownhostsfile": str(home / "kh")}
    target = resolve_target("n1", SshOptions(timeout=5), {
        "hostname": "127.0.0.1", "port": str(server.port), "proxyjump": "bastion",
        "identityfile": [str(home / "id_client")], "identitiesonly": "yes",
        "userknownhostsfile": str(home / "kh")}, "me",
        lookup=lambda name: jump_config if name == "bastion" else {})
    client = connect(target)
    assert server.log[:3] == ["login hop", f"direct-tcpip 127.0.0.1:{server.port}",
                              "login me"]
    client.close()
    jump_transport = server.transports[0]
    for _ in range(50):
        if not jump_transport.is_active():
            break
        threading.Event().wait(0.05)
    assert not jump_transport.is_active(), "the jump host's connection stayed open"


def test_connect_timeout_bounds_a_silent_server(home):
    """ConnectTimeout in ssh_config was ignored: dsrun waited --ssh_timeout's
    default (10 s) and said so."""
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        port = silent.getsockname()[1]
        target = resolve_target("n1", SshOptions(), {
            "hostname": "127.0.0.1", "port": str(port), "connecttimeout": "1",
            "identityfile": [str(home / "id_client")], "identitiesonly": "yes"}, "me")
        with pytest.raises(SshConnectError,
                           match=r"within 1s \(ConnectTimeout in ssh config\)"):
            _connects(target)


@pytest.mark.parametrize("form", ["pem", "openssh"])
def test_an_encrypted_key_without_ssh_agent_says_to_add_it(form, server, home):
    key = home / "id_locked"
    if form == "pem":
        CLIENT_KEY.write_private_key_file(str(key), password="secret")
    elif shutil.which("ssh-keygen") is None:
        pytest.skip("ssh-keygen not installed")
    else:  # paramiko's PKey.from_path raised TypeError for this one
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "secret", "-f", str(key)],
                       check=True, stdout=subprocess.DEVNULL)
    target = _target(home, server.port, _line(f"[127.0.0.1]:{server.port}", HOST_KEY),
                     identityfile=[str(key)])
    with pytest.raises(SshConnectError) as info:
        _connects(target)
    message = str(info.value)
    assert f"{key} (encrypted, and no ssh-agent (SSH_AUTH_SOCK is not set): load it with " \
           f"`ssh-add {key}`)" in message, message


def test_hosts_behind_one_jump_host_share_one_connection_to_it(server, home):
    """Every host behind a bastion opened its own connection to it, all at
    once (sshd's MaxStartups drops them from 10 on)."""
    (home / "kh").write_text(_line(f"[127.0.0.1]:{server.port}", HOST_KEY))
    common = {"hostname": "127.0.0.1", "port": str(server.port),
              "identityfile": [str(home / "id_client")], "identitiesonly": "yes",
              "userknownhostsfile": str(home / "kh")}
    jumps = {"bastion": {**common, "user": "hop"}}
    targets = [resolve_target(f"n{i}", SshOptions(timeout=5), {**common, "proxyjump": "bastion"},
                              "me", lookup=lambda name: jumps.get(name, {})) for i in range(4)]
    clients: list[paramiko.SSHClient] = []
    threads = [threading.Thread(target=lambda t=t: clients.append(connect(t))) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert len(clients) == 4 and server.log.count("login hop") == 1, server.log
    assert server.log.count("login me") == 4
    jump_transport = server.transports[0]
    for client in clients[:3]:
        client.close()
    assert jump_transport.is_active(), "closed while a host still used it"
    clients[3].close()
    for _ in range(50):
        if not jump_transport.is_active():
            break
        threading.Event().wait(0.05)
    assert not jump_transport.is_active(), "the last user left it open"
    connect(targets[0]).close()  # a later connection opens a new one
    assert server.log.count("login hop") == 2


def test_connect_timeout_does_not_bound_authentication(server, home, monkeypatch):
    """ConnectTimeout was also the authentication and channel timeout; ssh
    applies it to the connection and the handshake only."""
    check = _Server.check_auth_publickey

    def slow(self, username, key):
        threading.Event().wait(1.5)
        return check(self, username, key)

    monkeypatch.setattr(_Server, "check_auth_publickey", slow)
    (home / "kh").write_text(_line(f"[127.0.0.1]:{server.port}", HOST_KEY))
    target = resolve_target("n1", SshOptions(), {
        "hostname": "127.0.0.1", "port": str(server.port), "connecttimeout": "1",
        "identityfile": [str(home / "id_client")], "identitiesonly": "yes",
        "userknownhostsfile": str(home / "kh")}, "me")
    assert target.timeout == 1
    _connects(target)
    assert "login me" in server.log


def test_an_entry_under_the_hostfile_name_alone_is_not_used_and_the_error_says_so(
        server, home):
    """OpenSSH looks a host key up under HostKeyAlias, else the HostName it
    connects to; dsrun also took an entry under the hostfile's name (n1),
    so a stale line for that name vouched for whatever answered at the
    HostName."""
    known = _line(f"[n1]:{server.port}", HOST_KEY)
    with pytest.raises(SshConnectError) as info:
        _connects(_target(home, server.port, known))
    message = str(info.value)
    assert f"n1: host key of 127.0.0.1:{server.port} is not in known_hosts ({home / 'kh'}) " \
        f"under the name [127.0.0.1]:{server.port} or 127.0.0.1 (the entry " \
        f"{home / 'kh'}:1 for the hostfile's name n1 is not used" in message
    assert "set `HostKeyAlias n1`" in message
    assert f"ssh-keyscan -H -p {server.port} 127.0.0.1" in message
    _connects(_target(home, server.port, _line("n1", HOST_KEY), hostkeyalias="n1"))
