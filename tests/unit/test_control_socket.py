"""The launcher's control-socket directory: stale sockets (left by a
launcher that was SIGKILLed) are removed when the next launcher starts;
live ones are left alone. In-process sockets, no launcher."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from dsrun.launcher import control


@pytest.fixture()
def runtime_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    directory = Path(control.socket_dir())
    directory.mkdir(mode=0o700)
    return directory


def _stale(path: Path) -> None:
    """A socket file nobody listens on, as a SIGKILLed launcher leaves it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()


def test_a_starting_launcher_removes_stale_sockets_and_keeps_live_ones(
        runtime_dir: Path) -> None:
    _stale(runtime_dir / f"aaaaaaaaaaaa{control.SUFFIX}")
    _stale(runtime_dir / f"bbbbbbbbbbbb{control.SUFFIX}")
    (runtime_dir / "notes.txt").write_text("not a socket of ours")
    live = control.ControlServer("cccccccccccc-live", lambda: {"job_id": "cccccccccccc"}).start()
    try:
        assert live.path is not None
        assert sorted(os.listdir(runtime_dir)) == [f"cccccccccccc{control.SUFFIX}", "notes.txt"]
        # the next launcher leaves the live one alone, and it still answers
        other = control.ControlServer("dddddddddddd-next", lambda: {"job_id": "dd"}).start()
        try:
            assert control.remove_stale() == 0
            assert [j["job_id"] for j in control.running_jobs()] == ["cccccccccccc", "dd"]
        finally:
            other.close()
    finally:
        live.close()
    assert os.listdir(runtime_dir) == ["notes.txt"]


def test_remove_stale_counts_what_it_removed(runtime_dir: Path) -> None:
    _stale(runtime_dir / f"eeeeeeeeeeee{control.SUFFIX}")
    assert control.remove_stale() == 1 and os.listdir(runtime_dir) == []
    assert control.remove_stale() == 0


def test_no_usable_temporary_directory_is_no_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    """/tmp not writable and tempfile finding no usable directory: the
    socket directory is still named; binding there then fails with the
    usual warning instead of the launcher dying with a traceback."""
    import tempfile

    def none_usable() -> str:
        raise FileNotFoundError("No usable temporary directory found")

    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr(tempfile, "gettempdir", none_usable)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    assert control.socket_dir() == f"/tmp/dsrun-{os.getuid()}"


def test_the_socket_directory_does_not_follow_tmpdir(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    """A job started with its own TMPDIR (a batch system's) is found by
    ``dsrun stack`` from a shell without it."""
    import tempfile

    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile caches its choice
    assert control.socket_dir() == f"/tmp/dsrun-{os.getuid()}"
