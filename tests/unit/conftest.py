"""Unit tests do not read this machine's /etc/ssh/ssh_config: a site file
(Fedora/RHEL's crypto-policy Include, a ProxyJump for every host) would
change what the ssh tests resolve. Tests of the system file pass or patch
their own."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _no_system_ssh_config(monkeypatch: pytest.MonkeyPatch, tmp_path_factory) -> None:
    from dsrun.launcher.backends import ssh_connect

    missing = tmp_path_factory.getbasetemp() / "no-system-ssh_config"
    monkeypatch.setattr(ssh_connect, "SYSTEM_CONFIG", str(missing))
