"""What dsrun cannot read in the system-wide ssh_config (the site's file,
which the user neither chose nor can edit) does not stop a launch: Fedora
and RHEL's stock ``Match final all`` is read as ``Match final``, a line
paramiko refuses skips the file with one warning naming file:line, and a
Match block with criteria dsrun cannot evaluate is skipped, not applied to
every host. The crypto-policy settings that file brings are counted in
connection errors, not listed. The user's own file stays strict."""

from __future__ import annotations

import logging

import pytest

from dsrun.errors import DsrunUsageError
from dsrun.launcher import cli
from dsrun.launcher.backends import ssh_configfile, ssh_connect
from dsrun.launcher.backends.ssh_connect import config_lookup, resolve_target
from dsrun.launcher.spec import SshOptions

CRYPTO = ("Ciphers aes256-gcm@openssh.com,chacha20-poly1305@openssh.com,aes256-ctr\n"
          "MACs hmac-sha2-256-etm@openssh.com,hmac-sha1-etm@openssh.com\n"
          "GSSAPIKexAlgorithms gss-curve25519-sha256-,gss-nistp256-sha256-\n"
          "KexAlgorithms curve25519-sha256,curve25519-sha256@libssh.org\n"
          "PubkeyAcceptedAlgorithms ecdsa-sha2-nistp256,ssh-ed25519,rsa-sha2-256\n"
          "CASignatureAlgorithms ecdsa-sha2-nistp256,ssh-ed25519\n"
          "RequiredRSASize 2048\n")
# Fedora 40's /etc/ssh/ssh_config.d/50-redhat.conf, the Include made absolute
REDHAT = """\
# The options here are in the "Match final block" to be applied as the last
# options and could be potentially overwritten by the user configuration
Match final all
\t# Follow system-wide Crypto Policy, if defined:
\tInclude {crypto}

\tGSSAPIAuthentication yes

# If this option is set to yes then remote X11 clients will have full access
# to the original X11 display.
\tForwardX11Trusted yes

# Uncomment this if you want to have non ASCII characters displayed correctly
#\tSendEnv LANG LC_CTYPE
\tSendEnv LANG LC_CTYPE LC_NUMERIC LC_TIME LC_COLLATE LC_MONETARY LC_MESSAGES
"""


@pytest.fixture
def site(tmp_path, monkeypatch):
    """An empty ~/.ssh; the system files go under ``tmp_path / "etc"``."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home" / ".ssh").mkdir(parents=True)
    monkeypatch.setattr(ssh_configfile, "_warned", set(), raising=False)  # once per test
    return tmp_path


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def _fedora(root) -> str:
    crypto = _write(root / "crypto-policies" / "openssh.config", CRYPTO)
    _write(root / "etc" / "ssh_config.d" / "50-redhat.conf", REDHAT.format(crypto=crypto))
    return _write(root / "etc" / "ssh_config",
                  "Include ssh_config.d/*.conf\nHost *\n#   Port 22\n")


def test_fedoras_stock_system_config_is_read(site):
    system = _fedora(site)
    _write(site / "home" / ".ssh" / "config", "Host n1\n    User alice\n")
    found = config_lookup(None, system)("n1")
    assert found["user"] == "alice"
    assert found["ciphers"].startswith("aes256-gcm")  # the Match final block applies


def test_fedoras_stock_system_config_does_not_stop_a_dry_run(site, monkeypatch, capsys):
    monkeypatch.setattr(ssh_connect, "SYSTEM_CONFIG", _fedora(site))
    hostfile = _write(site / "hostfile", "n1 slots=1\nn2 slots=1\n")
    monkeypatch.chdir(site)
    _write(site / "t.py", "")
    assert cli.main(["--dry-run", "--cpu", "--hostfile", hostfile, "t.py"]) == 0, \
        capsys.readouterr().err


def test_match_final_all_in_the_users_file_is_read_as_match_final(site):
    mine = _write(site / "mine", "Host n1\n    User alice\nMatch final all\n    Port 2200\n")
    found = config_lookup(mine)("n1")
    assert (found["user"], found["port"]) == ("alice", "2200")


def test_a_system_file_paramiko_refuses_is_skipped_with_one_warning(site, caplog):
    _write(site / "etc" / "ssh_config.d" / "bad.conf", "Host *\n    Port 2200\nMatch all host x\n")
    system = _write(site / "etc" / "ssh_config", "Include ssh_config.d/*.conf\n")
    _write(site / "home" / ".ssh" / "config", "Host n1\n    User alice\n")
    with caplog.at_level(logging.WARNING):
        lookup = config_lookup(None, system)
        config_lookup(None, system)
    assert lookup("n1")["user"] == "alice" and "port" not in lookup("n1")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert f"{site}/etc/ssh_config.d/bad.conf:3:" in warnings[0]
    assert "Match does not allow 'all'" in warnings[0] and "--ssh_config" in warnings[0]


def test_the_users_own_file_stays_strict_and_names_the_line(site):
    _write(site / "home" / ".ssh" / "config", "Host n1\n    User alice\nMatch all host x\n")
    with pytest.raises(DsrunUsageError, match=r"\.ssh/config:3: Match does not allow 'all'"):
        config_lookup(None, str(site / "etc" / "absent"))
    mine = _write(site / "mine", "Host n1\n\n    Match all host x\n")
    with pytest.raises(DsrunUsageError, match=r"mine:3: Match does not allow 'all'"):
        config_lookup(mine)


def test_an_include_the_system_file_cannot_have_skips_it(site, caplog):
    _write(site / "etc" / "inner.conf", "Host a\n    User x\n")
    system = _write(site / "etc" / "ssh_config", "Host n1\n    Include inner.conf\n")
    with caplog.at_level(logging.WARNING):
        assert "user" not in config_lookup(None, system)("n1")
    assert "ssh_config:2: the Include inside `Host n1`" in caplog.text


def test_crypto_policy_settings_of_the_system_file_are_counted_not_listed(site):
    system = _write(site / "etc" / "ssh_config", "Host *\n" + CRYPTO)
    _write(site / "home" / ".ssh" / "config",
           "Host n1\n    BindAddress 10.0.0.1\nHost *\n    MACs hmac-sha2-256\n")
    target = resolve_target("n1", SshOptions(), config_lookup(None, system)("n1"), "me")
    assert target.notes == ("3 settings of the system-wide " + system + " (not listed)",
                            "BindAddress 10.0.0.1", "MACs hmac-sha2-256")
    assert "aes256" not in " ".join(target.notes)  # Ciphers, KexAlgorithms, PubkeyAccepted...


def test_a_site_match_block_dsrun_cannot_evaluate_is_skipped(site, caplog):
    system = _write(site / "etc" / "ssh_config",
                    "Host n*\n    Port 2200\n"
                    "Match localnetwork 192.168.7.0/24\n    ProxyJump gateway\n    User guest\n"
                    "Host *\n    ConnectTimeout 5\n")
    with caplog.at_level(logging.WARNING):
        found = config_lookup(None, system)("n1")
    assert "proxyjump" not in found and "user" not in found
    assert (found["port"], found["connecttimeout"]) == ("2200", "5")
    assert "ssh_config:3: dsrun cannot evaluate `Match localnetwork`" in caplog.text


def test_the_users_match_block_dsrun_cannot_evaluate_still_applies_with_a_note(site):
    """Unchanged for the user's own file: applied, and named in errors."""
    _write(site / "home" / ".ssh" / "config",
           "Match localnetwork 192.168.7.0/24\n    User guest\n")
    found = config_lookup(None, str(site / "etc" / "absent"))("n1")
    assert found["user"] == "guest"
    assert "`Match localnetwork`" in found[ssh_connect.NOTES_KEY][0]
