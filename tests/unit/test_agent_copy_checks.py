"""Which dsrun copy a node agent runs, and the probe's check of the
--log_dir files: the remote agent gets the ranks' PYTHONPATH, and the
preflight tells another copy of the same version from the launcher's."""

from __future__ import annotations

import shutil
from pathlib import Path

from dsrun.launcher.agent_os import dsrun_sources
from dsrun.launcher.agent_prelude import probe_extras
from dsrun.launcher.backends.ssh import remote_command
from dsrun.launcher.preflight import Expectations, evaluate

FACTS = {"host": "h2", "python": "3.11.7", "dsrun": "0.1.0", "torch": "2.13.0",
         "devices": [], "cpus": 4}


def test_the_remote_agent_gets_the_ranks_pythonpath_quoted():
    words = "DSRUN_PYTHONPATH_WAS=\"${PYTHONPATH+:$PYTHONPATH}\" PYTHONPATH='/my checkout:/lib'"
    assert remote_command("/v/bin/python", "/w", words) == (
        f"cd /w || exit 96; exec env {words} /v/bin/python -m dsrun.launcher.agent")
    assert remote_command("/v/bin/python", "/w", None) == (
        "cd /w || exit 96; exec /v/bin/python -m dsrun.launcher.agent")


def test_a_copy_with_other_sources_differs_by_digest(tmp_path: Path):
    path, digest = dsrun_sources()
    assert Path(path, "launcher", "agent.py").is_file() and len(digest) == 16
    copy = tmp_path / "dsrun"
    shutil.copytree(path, copy, ignore=shutil.ignore_patterns("__pycache__"))

    def digest_of(root: Path) -> str:
        return dsrun_sources(str(root))[1]

    assert digest_of(copy) == digest, "an identical copy elsewhere is the same dsrun"
    with open(copy / "launcher" / "agent.py", "a") as f:
        f.write("# changed\n")
    assert digest_of(copy) != digest


def test_preflight_names_another_copy_of_the_same_version():
    expect = Expectations(python="3.11.7", dsrun="0.1.0", torch="2.13.0",
                          dsrun_path="/work/main/dsrun", dsrun_digest="aaaa")
    other = {**FACTS, "dsrun_path": "/opt/venv/lib/dsrun", "dsrun_digest": "bbbb"}
    report = evaluate("h2", other, None, expect, [0], "worker", None, cpu=True)
    assert not report.ok() and report.ok(strict=False)  # a mismatch, as versions are
    assert "dsrun 0.1.0 at /opt/venv/lib/dsrun is another copy than the launcher's " \
        "(/work/main/dsrun)" in report.line()
    same = {**FACTS, "dsrun_path": "/elsewhere/dsrun", "dsrun_digest": "aaaa"}
    assert evaluate("h2", same, None, expect, [0], "worker", None, cpu=True).ok()
    older = dict(FACTS)  # an agent that sends no digest is not compared
    assert evaluate("h2", older, None, expect, [0], "worker", None, cpu=True).ok()


def test_probe_checks_the_log_files_before_any_rank(tmp_path: Path):
    (tmp_path / "rank_1.log").mkdir()
    ok = probe_extras({"versions": False, "log_files": [str(tmp_path / "d" / "rank_0.log")]})
    assert ok == {"log_files": None}
    assert not (tmp_path / "d").exists(), "the check left what it made (a launch may not start)"
    (tmp_path / "kept.log").write_text("an earlier job's\n")
    assert probe_extras({"versions": False, "log_files": [str(tmp_path / "kept.log")]}) == \
        {"log_files": None}
    assert (tmp_path / "kept.log").read_text() == "an earlier job's\n"
    bad = probe_extras({"versions": False, "log_files": [str(tmp_path / "rank_0.log"),
                                                         str(tmp_path / "rank_1.log")]})
    assert not (tmp_path / "rank_0.log").exists()
    assert bad["log_files"] == (f"cannot open the --log_dir file {tmp_path / 'rank_1.log'}: "
                                "[Errno 21] Is a directory")
    report = evaluate("h2", {**FACTS, **bad}, None, Expectations("3.11.7", "0.1.0", None),
                      [0], "worker", None, cpu=True)
    assert not report.ok(strict=False) and "rank_1.log: [Errno 21]" in report.line()
    assert "dsrun_digest" in probe_extras({"versions": True})


def test_log_check_survives_another_hosts_check_removing_the_directory(tmp_path: Path,
                                                                        monkeypatch):
    # Hosts sharing a --log_dir on NFS check it at once: another host's check
    # removes the directory it made between this one's makedirs and open.
    import os

    target = tmp_path / "shared" / "rank_3.log"
    real_open = os.open
    removed = []

    def open_after_the_other_host_cleaned(path, flags, mode=0o777, **kw):
        if str(path) == str(target) and not removed:
            removed.append(True)
            os.rmdir(target.parent)
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(os, "open", open_after_the_other_host_cleaned)
    assert probe_extras({"versions": False, "log_files": [str(target)]}) == {"log_files": None}
    assert removed and not (tmp_path / "shared").exists()
