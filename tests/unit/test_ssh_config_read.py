"""Reading ssh_config and known_hosts as OpenSSH does, without connecting:
Include, ProxyJump/ProxyCommand resolution, ConnectTimeout, HostKeyAlias,
notes on what dsrun cannot evaluate, the default login user, and the
known_hosts parser (markers, malformed lines, hashes, port fallback)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import pwd

import paramiko
import pytest

from dsrun.errors import DsrunUsageError
from dsrun.launcher.backends.ssh import SshBackend
from dsrun.launcher.backends.ssh_connect import config_lookup, resolve_target
from dsrun.launcher.spec import DEFAULT_SSH_TIMEOUT, HostsSpec, SshOptions

KEY = paramiko.ECDSAKey.generate()
OTHER = paramiko.ECDSAKey.generate()


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / ".ssh" / "config.d").mkdir(parents=True)
    return tmp_path


def _write(path, text):
    path.write_text(text)
    return str(path)


def test_include_relative_to_dot_ssh_with_globs_and_blocks(home):
    """paramiko dropped Include lines: hosts defined in included files
    could not be resolved."""
    _write(home / ".ssh" / "config.d" / "b-cluster", "Host bravo\n    HostName 10.0.0.2\n")
    _write(home / ".ssh" / "config.d" / "a-lab", "Host lab-*\n    User labuser\n")
    config = _write(home / ".ssh" / "config",
                    "Include config.d/*\nUser everyone\n\nHost gamma\n    HostName 10.0.0.3\n")
    lookup = config_lookup(config)
    assert lookup("bravo")["hostname"] == "10.0.0.2"
    assert lookup("lab-1")["user"] == "labuser"
    # the line after the Include is in the top-level block again
    assert lookup("bravo")["user"] == "everyone"
    assert lookup("gamma")["hostname"] == "10.0.0.3"


def test_include_inside_a_block_and_its_errors(home):
    _write(home / ".ssh" / "common", "User shared\nPort 2200\n")
    nested = _write(home / ".ssh" / "config",
                    "Host a*\n    Include ~/.ssh/common\n    HostName 10.0.0.9\n")
    assert {k: config_lookup(nested)("a1")[k] for k in ("user", "port", "hostname")} == \
        {"user": "shared", "port": "2200", "hostname": "10.0.0.9"}
    assert "user" not in config_lookup(nested)("b1")
    loop = _write(home / ".ssh" / "loop", "Include loop\n")
    with pytest.raises(DsrunUsageError, match=r"loop:1: Include nested more than 16"):
        config_lookup(loop)
    _write(home / ".ssh" / "blocks", "Host x\n  User y\n")
    inner = _write(home / ".ssh" / "inner", "Host a\n  Include blocks\n")
    with pytest.raises(DsrunUsageError, match=r"inner:2: the Include inside `Host a`"):
        config_lookup(inner)


def test_proxy_jump_chain_uses_each_jump_hosts_own_config(home):
    config = _write(home / ".ssh" / "config", """
Host gamma
    HostName 10.0.22.2
    ProxyJump alice@alpha:2222,beta
Host alpha
    HostName 10.0.0.1
    IdentityFile ~/.ssh/id_alpha
Host beta
    HostName 10.0.0.2
    User bob
    ProxyJump elsewhere
Host *
    User carol
""")
    lookup = config_lookup(config)
    options = SshOptions(port=2000, user="dave", timeout=4)
    t = resolve_target("gamma", options, lookup("gamma"), "me", lookup)
    assert (t.hostname, t.port, t.user) == ("10.0.22.2", 2000, "dave")
    beta = t.jump
    # the flags are for the job's hosts; -J's list replaces beta's own ProxyJump
    assert (beta.host, beta.hostname, beta.port, beta.user) == ("beta", "10.0.0.2", 22, "bob")
    alpha = beta.jump
    assert (alpha.hostname, alpha.port, alpha.user, alpha.jump) == ("10.0.0.1", 2222, "alice",
                                                                    None)
    assert alpha.keys == (str(home / ".ssh" / "id_alpha"),) and alpha.timeout == 4
    assert t.describe() == "ssh dave@10.0.22.2:2000 (via beta)"


def test_proxy_settings_errors_and_none(home):
    config = _write(home / ".ssh" / "config", """
Host loop
    ProxyJump loop
Host both
    ProxyJump a
    ProxyCommand nc %h %p
Host off
    ProxyJump none
Host bad
    ProxyJump a:0
Host cmd
    ProxyCommand ssh -W %h:%p -l %r bastion # %n %%
""")
    lookup = config_lookup(config)
    for host, message in [("loop", "ProxyJump loop for host loop"),
                          ("bad", "bad ProxyJump 'a:0' for host bad")]:
        with pytest.raises(DsrunUsageError, match=message):
            resolve_target(host, SshOptions(), lookup(host), "me", lookup)
    off = resolve_target("off", SshOptions(), lookup("off"), "me", lookup)
    assert off.jump is None and off.proxy_command is None
    cmd = resolve_target("cmd", SshOptions(port=2222), lookup("cmd"), "me", lookup)
    # tokens are kept until connecting, where --ssh_port/--ssh_user count
    assert cmd.proxy_command == "ssh -W %h:%p -l %r bastion # %n %%"


def test_connect_timeout_applies_unless_ssh_timeout_is_given():
    config = {"connecttimeout": "3"}
    from_config = resolve_target("h", SshOptions(), config, "me")
    assert from_config.timeout == 3
    assert from_config.timeout_from == "ConnectTimeout in ssh config"
    assert resolve_target("h", SshOptions(timeout=7, timeout_given=True), config,
                          "me").timeout == 7
    assert resolve_target("h", SshOptions(), {}, "me").timeout == DEFAULT_SSH_TIMEOUT
    for bad in ("x", "1.5", "-3", "1m x"):
        with pytest.raises(DsrunUsageError, match=f"bad ConnectTimeout '{bad}' for host h"):
            resolve_target("h", SshOptions(), {"connecttimeout": bad}, "me")


@pytest.mark.parametrize(("text", "seconds"), [
    ("30s", 30), ("1m", 60), ("1M", 60), ("1m30s", 90), ("1h", 3600), ("10S", 10),
    ("2w", 1209600), ("90", 90), ("0", DEFAULT_SSH_TIMEOUT), ("none", DEFAULT_SSH_TIMEOUT)])
def test_connect_timeout_takes_openssh_time_formats(text, seconds):
    """ssh -G -o ConnectTimeout=1m prints 60; dsrun refused every unit, and
    0 (ssh: the system's TCP timeout) as a bad value."""
    target = resolve_target("h", SshOptions(), {"connecttimeout": text}, "me")
    assert target.timeout == seconds


def test_an_ssh_timeout_equal_to_the_default_still_wins_over_connect_timeout():
    """--ssh_timeout 10 (the default's value) counted as not given."""
    from dsrun.launcher import cli

    spec = cli.parse_spec(["--ssh_timeout", f"{DEFAULT_SSH_TIMEOUT:g}", "t.py"])
    assert spec.ssh.timeout_given and spec.ssh.timeout == DEFAULT_SSH_TIMEOUT
    target = resolve_target("h", spec.ssh, {"connecttimeout": "3"}, "me")
    assert (target.timeout, target.timeout_from) == (DEFAULT_SSH_TIMEOUT, "--ssh_timeout")
    plain = cli.parse_spec(["t.py"]).ssh
    assert not plain.timeout_given and plain.timeout == DEFAULT_SSH_TIMEOUT
    assert resolve_target("h", plain, {"connecttimeout": "3"}, "me").timeout == 3


def test_the_first_of_proxycommand_and_proxyjump_wins_none_included(home):
    """OpenSSH: whichever is specified first prevents later instances of
    the other. dsrun refused `ProxyCommand none` for the bastion followed by
    `Host * / ProxyJump bastion` (a "loop", for every host), and refused
    both in one block."""
    config = _write(home / ".ssh" / "config", """
Host bastion
    HostName 10.0.0.1
    ProxyCommand none
Host cmd-first
    ProxyCommand nc %h %p
    ProxyJump a
Host jump-first
    ProxyJump a
    ProxyCommand nc %h %p
Host *
    ProxyJump bastion
""")
    lookup = config_lookup(config)

    def proxy(host):
        t = resolve_target(host, SshOptions(), lookup(host), "me", lookup)
        return t.proxy_command, t.jump.host if t.jump else None

    assert proxy("bastion") == (None, None)
    assert proxy("node1") == (None, "bastion")
    assert proxy("cmd-first") == ("nc %h %p", None)
    assert proxy("jump-first") == (None, "a")


def test_a_proxy_jump_chain_is_token_expanded_once(home):
    """The hops before the last were expanded again on the jump host: a
    scope id (%eth0, from %%eth0) failed as an unknown token."""
    config = _write(home / ".ssh" / "config",
                    "Host n1\n    ProxyJump [fe80::1%%eth0]:2222,bastion\n")
    lookup = config_lookup(config)
    bastion = resolve_target("n1", SshOptions(), lookup("n1"), "me", lookup).jump
    assert bastion.host == "bastion"
    assert (bastion.jump.host, bastion.jump.port) == ("fe80::1%eth0", 2222)


def test_host_key_alias_and_port_fallback_names():
    from dsrun.launcher.backends.ssh_connect import key_names

    t = resolve_target("n1", SshOptions(port=2222), {"hostname": "10.0.0.1"}, "me")
    # as OpenSSH: the HostName only, never the hostfile's name (n1)
    assert key_names(t) == (["[10.0.0.1]:2222"], ["10.0.0.1"])
    alias = resolve_target("n1", SshOptions(), {"hostname": "10.0.0.1",
                                                "hostkeyalias": "node-one"}, "me")
    assert key_names(alias) == (["node-one"], [])


def test_unhonoured_settings_and_match_forms_are_noted(home):
    config = _write(home / ".ssh" / "config", """
Match localnetwork 10.0.0.0/8
    User netuser
Host n*
    CertificateFile ~/.ssh/id-cert.pub
    ForwardAgent yes
""")
    lookup = config_lookup(config)
    notes = resolve_target("n1", SshOptions(), lookup("n1"), "me", lookup).notes
    assert any("`Match localnetwork`" in n and "config:2" in n for n in notes), notes
    assert "CertificateFile ~/.ssh/id-cert.pub" in notes and "ForwardAgent yes" in notes


def test_default_user_is_the_uids_login_name_not_USER(monkeypatch):
    """After `su` (without -) USER/LOGNAME still name the old user; ssh logs
    in as the uid's passwd name."""
    monkeypatch.setenv("USER", "alice-not-me")
    monkeypatch.setenv("LOGNAME", "alice-not-me")
    backend = SshBackend(HostsSpec(), lookup=lambda host: {}, environ={})
    assert backend.target("n1").user == pwd.getpwuid(os.getuid()).pw_name


def _line(names, key, marker=""):
    return f"{marker} {names} {key.get_name()} {key.get_base64()}".strip()


def test_known_hosts_lines_markers_and_malformed(tmp_path):
    from dsrun.launcher.backends.ssh_known import KnownHosts, check_key, parse_text

    warned = []
    salt = os.urandom(20)
    digest = hmac.new(salt, b"hashed-host", hashlib.sha1).digest()
    hashed = f"|1|{base64.b64encode(salt).decode()}|{base64.b64encode(digest).decode()}"
    text = "\n".join([
        "# comment", "",
        _line("*.example.org", OTHER, "@cert-authority"),
        _line("bad.example.org", KEY, "@revoked"),
        "@unknown-marker h ssh-ed25519 AAAA",
        "onlyonefield",
        f"h ssh-ed25519 {OTHER.get_base64()}",  # the type does not match the data
        _line("node?,!node9,[n1]:2222", KEY),
        _line(hashed, KEY),
    ])
    keys = parse_text(text, "kh", warned.append)
    assert [k.line for k in keys] == [3, 4, 8, 9]
    assert [w.split(": ", 1)[0] for w in warned] == ["known_hosts kh:5", "known_hosts kh:6",
                                                     "known_hosts kh:7"]
    assert "unknown marker @unknown-marker" in warned[0]
    known = KnownHosts(keys)
    blob = KEY.asbytes()
    assert check_key(known, ["hashed-host"], [], KEY.get_name(), blob).kind == "ok"
    assert check_key(known, ["NODE1"], [], KEY.get_name(), blob).kind == "ok"
    assert check_key(known, ["node9"], [], KEY.get_name(), blob).kind == "unknown"
    assert check_key(known, ["[n1]:2222"], [], KEY.get_name(), blob).kind == "ok"
    assert check_key(known, ["node1"], [], OTHER.get_name(), OTHER.asbytes()).kind == "changed"
    revoked = check_key(known, ["bad.example.org"], [], KEY.get_name(), blob)
    assert revoked.kind == "revoked" and revoked.entry.line == 4
    ca = check_key(known, ["x.example.org"], [], KEY.get_name(), blob)
    assert ca.kind == "unknown" and ca.entry.marker == "cert-authority"
    # a non-22 port: the port-less entry counts when the [host]:port one is missing
    assert check_key(known, ["[node1]:2222"], ["node1"], KEY.get_name(), blob).kind == "ok"
    assert check_key(known, ["[node1]:2222"], ["node1"], OTHER.get_name(),
                     OTHER.asbytes()).kind == "changed"


def test_a_proxied_hostname_of_loopback_is_not_this_machine():
    """HostName 127.0.0.1 behind a ProxyJump is the jump host itself, not
    the launcher's machine: it was run locally, without SSH."""
    configs = {"behind": {"hostname": "127.0.0.1", "proxyjump": "bastion"},
               "cmd": {"hostname": "127.0.0.1", "proxycommand": "ssh -W %h:%p bastion"},
               "plain": {"hostname": "127.0.0.1"}, "bastion": {"hostname": "10.9.9.9"}}
    backend = SshBackend(HostsSpec(), lookup=lambda host: dict(configs.get(host, {})),
                         user="me", environ={})
    assert backend.local_hosts(["behind", "cmd", "plain"], "launcher", ["10.0.0.5"]) == \
        [False, False, True]


def test_a_proxied_host_is_never_this_machine_by_its_hostfile_name():
    """Only the HostName was guarded: a hostfile name that is one of this
    machine's addresses (a LAN range the cluster behind the bastion also
    uses), its short name, or localhost still ran that host's ranks here."""
    configs = {"192.168.1.10": {"hostname": "192.168.1.10", "proxyjump": "bastion"},
               "node1": {"hostname": "10.0.0.7", "proxyjump": "bastion"},
               "localhost": {"proxycommand": "ssh -W %h:%p bastion"},
               "bastion": {"hostname": "10.9.9.9"}}
    backend = SshBackend(HostsSpec(), lookup=lambda host: dict(configs.get(host, {})),
                         user="me", environ={})
    hosts = ["192.168.1.10", "node1", "localhost", "192.168.1.11"]
    assert backend.local_hosts(hosts, "node1.laptop", ["192.168.1.10", "192.168.1.11"]) == \
        [False, False, False, True]


def test_the_hostnames_entry_decides_before_the_hostfile_names():
    """Entries under the HostName and the hostfile's name were one group:
    a stale ``gamma K2`` line vouched for whatever presented K2 at
    10.0.0.5, whose own entry says K1."""
    from dsrun.launcher.backends.ssh_connect import key_names
    from dsrun.launcher.backends.ssh_known import KnownHosts, check_key, parse_text

    def verdict(lines, port=22, key=KEY):
        known = KnownHosts(parse_text("\n".join(lines), "kh"))
        target = resolve_target("gamma", SshOptions(port=port), {"hostname": "10.0.0.5"}, "me")
        names, fallback = key_names(target)
        return known.key_types(names, fallback), \
            check_key(known, names, fallback, key.get_name(), key.asbytes())

    types, changed = verdict([_line("10.0.0.5", OTHER), _line("gamma", KEY)])
    assert changed.kind == "changed" and changed.name == "10.0.0.5" and changed.entry.line == 1
    assert types == [OTHER.get_name()]
    # no HostName entry: the hostfile name's entry does not vouch for it (OpenSSH
    # looks up the HostName only)
    assert verdict([_line("gamma", KEY)])[1].kind == "unknown"
    ported = verdict([_line("[10.0.0.5]:2222", OTHER), _line("[gamma]:2222", KEY)], 2222)[1]
    assert ported.kind == "changed" and not ported.portless
    portless = verdict([_line("10.0.0.5", OTHER), _line("gamma", KEY)], 2222)[1]
    assert portless.kind == "changed" and portless.portless and portless.name == "10.0.0.5"


def test_user_names_with_shell_metacharacters_are_refused():
    """--ssh_user went unquoted into ProxyCommand's shell as %r:
    `--ssh_user 'x;cmd'` ran cmd (OpenSSH 9.6 refuses such names)."""
    config = {"hostname": "10.0.0.1", "proxycommand": "ssh -W %h:%p -l %r bastion"}
    for bad in ("x;touch /tmp/p", "a b", "$(id)", "-oProxyCommand=x", "x`id`", "u|v"):
        with pytest.raises(DsrunUsageError, match=r"--ssh_user: bad user name"):
            resolve_target("n1", SshOptions(user=bad), config, "me")
    for good in ("alice", "first.last", "DOMAIN\\bob", "bob@corp.example", "host$", "a-b_c"):
        assert resolve_target("n1", SshOptions(user=good), config, "me").user == good
    jumps = {"proxyjump": "x;id@bastion"}
    with pytest.raises(DsrunUsageError, match=r"ProxyJump 'x;id@bastion' for host n1: bad "
                                              r"user name 'x;id'"):
        resolve_target("n1", SshOptions(), jumps, "me", lambda name: {})


def test_a_proxy_commands_pipes_are_all_closed(monkeypatch):
    """stderr stayed open (one fd per proxied connection until GC)."""
    from dsrun.launcher.backends.ssh_proxy import ShellProxyCommand

    monkeypatch.setenv("SHELL", "/bin/sh")
    proxy = ShellProxyCommand("cat")
    proxy.close()
    assert proxy.process.stdin.closed and proxy.process.stdout.closed
    assert proxy.process.stderr.closed


def test_match_notes_go_only_to_hosts_the_block_applies_to(home):
    """Every Match note of the file was attached to every host's errors."""
    _write(home / ".ssh" / "config.d" / "a", "Host a*\n    User a\n")
    config = _write(home / ".ssh" / "config", """
Include config.d/*
Host gpu-*
    Port 2222
Match host gpu-* localnetwork 10.0.0.0/8
    User netuser
Match localnetwork 192.168.0.0/16
    ForwardAgent no
""")
    lookup = config_lookup(config)

    def notes(host):
        return [n.split("`")[1] for n in
                resolve_target(host, SshOptions(), lookup(host), "me", lookup).notes]

    assert notes("gpu-1") == ["Match localnetwork", "Match localnetwork"]
    assert notes("cpu-1") == ["Match localnetwork"]
    assert "config:7" in resolve_target("cpu-1", SshOptions(), lookup("cpu-1"), "me").notes[0]
