"""The system-wide ssh_config (/etc/ssh/ssh_config) is read after
~/.ssh/config, as OpenSSH reads it: the first value obtained wins,
IdentityFile lines add up, the system file's relative Includes are taken
from its own directory, and ``--ssh_config`` (``ssh -F``) reads its file
alone. dsrun read only the user's file: a site's HostName, User or
ProxyJump set in /etc/ssh/ssh_config was not used."""

from __future__ import annotations

import pytest

from dsrun.launcher.backends import ssh_connect
from dsrun.launcher.backends.ssh import SshBackend
from dsrun.launcher.backends.ssh_connect import config_lookup
from dsrun.launcher.spec import HostsSpec, SshOptions


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home" / ".ssh").mkdir(parents=True)
    (tmp_path / "etc").mkdir()
    return tmp_path


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def test_the_system_file_fills_in_what_the_user_file_leaves_out(home):
    _write(home / "home" / ".ssh" / "config",
           "Host n1\n    User alice\n    IdentityFile ~/.ssh/mine\nHost other\n    Port 2022\n")
    system = _write(home / "etc" / "ssh_config",
                    "Port 2200\nHost n*\n    User bob\n    HostName 10.0.0.9\n"
                    "    IdentityFile /etc/site_key\n")
    found = config_lookup(None, system)("n1")
    assert found["user"] == "alice"  # the user file's value comes first and wins
    assert found["hostname"] == "10.0.0.9"  # not the name itself, paramiko's stand-in
    assert found["port"] == "2200"  # before the system file's first Host: every host
    assert found["identityfile"] == [str(home / "home" / ".ssh" / "mine"), "/etc/site_key"]


def test_the_system_file_alone_is_read(home):
    system = _write(home / "etc" / "ssh_config", "Host n1\n    User bob\n")
    assert config_lookup(None, system)("n1")["user"] == "bob"


def test_relative_includes_of_the_system_file_are_in_its_directory(home):
    _write(home / "etc" / "ssh_config.d" / "site.conf", "Host n1\n    HostName 10.1.1.1\n")
    system = _write(home / "etc" / "ssh_config", "Include ssh_config.d/*.conf\n")
    assert config_lookup(None, system)("n1")["hostname"] == "10.1.1.1"


def test_ssh_config_flag_reads_its_file_alone(home):
    mine = _write(home / "mine", "Host n1\n    User alice\n")
    system = _write(home / "etc" / "ssh_config", "Host *\n    Port 2200\n")
    found = config_lookup(mine, system)("n1")
    assert found["user"] == "alice" and "port" not in found


def test_the_backend_reads_the_system_file(home, monkeypatch):
    system = _write(home / "etc" / "ssh_config",
                    "Host n1\n    HostName 10.0.0.7\n    User siteuser\n")
    monkeypatch.setattr(ssh_connect, "SYSTEM_CONFIG", system)
    backend = SshBackend(HostsSpec(ssh=SshOptions()), user="me")
    target = backend.target("n1")
    assert (target.hostname, target.user) == ("10.0.0.7", "siteuser")


def test_a_system_file_that_cannot_be_read_is_passed_over(home, monkeypatch):
    """As ssh does (it skips a default file it cannot open); dsrun would stop
    every launch with "cannot read ssh config"."""
    import os

    system = _write(home / "etc" / "ssh_config", "Host n1\n    User bob\n")
    real_access = os.access
    monkeypatch.setattr(ssh_connect.os, "access",
                        lambda path, mode: path != system and real_access(path, mode))
    assert "user" not in config_lookup(None, system)("n1")


@pytest.mark.skipif(__import__("os").getuid() == 0, reason="root reads a mode-000 file")
def test_a_mode_000_system_file_is_passed_over(home):
    system = _write(home / "etc" / "ssh_config", "Host n1\n    User bob\n")
    (home / "etc" / "ssh_config").chmod(0)
    assert "user" not in config_lookup(None, system)("n1")
