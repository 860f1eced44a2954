"""Preflight verdicts (pure) and host selection errors at the CLI boundary."""

from __future__ import annotations

import pytest

from dsrun.launcher import cli
from dsrun.launcher.cluster import _rendezvous
from dsrun.launcher.preflight import Expectations, Rendezvous, evaluate

EXPECT = Expectations(python="3.11.7", dsrun="0.1.0", torch="2.13.0")
FACTS = {"host": "n2", "python": "3.11.7", "dsrun": "0.1.0", "torch": "2.13.0",
         "devices": [], "cpus": 2, "ifname": "eth0",
         "reach": {"error": None, "seconds": 0.001}}
MASTER = Rendezvous("10.0.0.1", 29500)


def test_healthy_worker():
    report = evaluate("n2", FACTS, None, EXPECT, (0, 1), "worker", MASTER)
    assert report.ok()
    assert report.line() == ("n2  ok    n2: python 3.11.7, dsrun 0.1.0, torch 2.13.0, "
                             "no GPU: 2 CPU rank(s), reaches master 10.0.0.1:29500, via eth0")


def test_version_mismatch_fails_unless_not_strict():
    facts = {**FACTS, "torch": "2.12.0", "dsrun": "0.0.9"}
    report = evaluate("n2", facts, None, EXPECT, (0,), "worker", MASTER)
    assert not report.ok() and report.ok(strict=False)
    assert report.line() == ("n2  FAIL  dsrun 0.0.9 (launcher: 0.1.0); "
                             "torch 2.12.0 (launcher: 2.13.0)")
    missing = evaluate("n2", {**FACTS, "torch": None}, None, EXPECT, (0,), "worker", MASTER)
    assert "torch not installed (launcher: 2.13.0)" in missing.mismatches


def test_unreachable_master_and_too_few_gpus():
    facts = {**FACTS, "devices": [0, 1], "reach": {"error": "cannot connect to x: refused"}}
    report = evaluate("n2", facts, None, EXPECT, (0, 2), "worker", MASTER)
    assert report.errors == ("n2 has 2 GPU(s) but slots up to index 2 are selected",)
    assert report.mismatches == ("cannot reach the master: cannot connect to x: refused",)
    assert not report.ok(strict=False)  # missing devices can never be skipped


def test_cpu_jobs_do_not_check_gpus():
    report = evaluate("n2", {**FACTS, "devices": [0]}, None, EXPECT, (0, 1, 2), "worker",
                      MASTER, cpu=True)
    assert report.errors == () and "--cpu: 3 CPU rank(s)" in report.line(width=2)


def test_no_answer_is_an_error():
    report = evaluate("n3", None, "n3: connection refused by 10.0.0.3:22", EXPECT, (0,),
                      "worker", MASTER)
    assert report.line(width=4) == "n3    FAIL  n3: connection refused by 10.0.0.3:22"


def test_rendezvous_from_master_facts():
    assert _rendezvous("n1", {"master": {"addr": "10.0.0.1", "port": 5, "error": None}},
                       None) == (Rendezvous("10.0.0.1", 5), None)
    # the master found no usable address: fall back to the one SSH used
    assert _rendezvous("n1", {"master": {"addr": None, "port": 5}}, "10.0.0.9")[0] == \
        Rendezvous("10.0.0.9", 5)
    assert "pass --master_addr" in _rendezvous("n1", {"master": {"addr": None, "port": 5}},
                                               "127.0.0.1")[1]
    assert _rendezvous("n1", {"master": {"error": "port 5 is not free: in use"}},
                       None)[1] == "master port 5 is not free: in use"


# -- bad host input at the CLI: one error line, exit 2, nothing started ----------


def _main_err(capsys, argv) -> tuple[int, list[str]]:
    code = cli.main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "t.py"
    path.write_text("")
    return str(path)


def test_named_hostfile_missing(tmp_path, capsys, script):
    code, err = _main_err(capsys, ["-H", str(tmp_path / "nope"), script])
    assert code == 2 and err == [f"dsrun: error: hostfile '{tmp_path}/nope' does not exist"]


def test_bad_hostfile_names_file_line_column(tmp_path, capsys, script):
    hostfile = tmp_path / "hf"
    hostfile.write_text("node1 slots=2\nnode2 slot=2\n")
    code, err = _main_err(capsys, ["-H", str(hostfile), script])
    assert code == 2
    assert err == [f"dsrun: error: {hostfile}:2:7: expected 'slots=N' after the host, "
                   f"got 'slot=2'"]


@pytest.mark.parametrize("flags,message", [
    (["--include", "node9"], "--include 'node9': unknown host 'node9', not in hostfile"),
    (["--include", "node1", "--exclude", "node2"],
     "--include and --exclude are mutually exclusive"),
    (["--exclude", "node1@node2"], "--exclude 'node1@node2' leaves no slots to run on"),
    (["--num_nodes", "3"], "--num_nodes 3 asks for more hosts than the 2 available"),
    (["--include", "node1:5"], "slot 5 is out of range for host 'node1'"),
])
def test_bad_selection(tmp_path, capsys, script, flags, message):
    hostfile = tmp_path / "hf"
    hostfile.write_text("node1 slots=2\nnode2 slots=2\n")
    code, err = _main_err(capsys, ["-H", str(hostfile), *flags, script])
    assert code == 2 and len(err) == 1 and message in err[0], err


def test_launcher_local_refuses_remote_hosts(tmp_path, capsys, script):
    hostfile = tmp_path / "hf"
    hostfile.write_text("localhost slots=1\nnode-far slots=1\n")
    code, err = _main_err(capsys, ["-H", str(hostfile), "--launcher", "local", script])
    assert code == 2
    assert err == [f"dsrun: error: --launcher local cannot start ranks on node-far "
                   f"(from {hostfile}), which is not this host; use ssh"]


def test_local_only_hostfile_runs_locally_without_ssh(tmp_path, capsys, script, monkeypatch):
    hostfile = tmp_path / "hf"
    hostfile.write_text("localhost slots=3\n")
    monkeypatch.setenv("DSRUN_FAKE_GPUS", "0")
    assert cli.main(["-H", str(hostfile), "--dry-run", script]) == 0
    out = capsys.readouterr().out
    assert "world size 3 on 1 node(s), master 127.0.0.1:" in out
    assert "node " in out and "ssh" not in out


@pytest.mark.parametrize("include,shown", [("far-a:1,2", "GPUs 1,2 if"),
                                           ("far-a:0,1", "GPUs 0,1 if")])
def test_dry_run_shows_the_slots_selected_on_a_remote_host(tmp_path, capsys, script,
                                                           include, shown):
    """--include far-a:1,2 and far-a:0,1 printed the same rank map."""
    hostfile = tmp_path / "hf"
    hostfile.write_text("far-a slots=4\n")
    config = tmp_path / "ssh_config"
    config.write_text("Host far-*\n    HostName 192.0.2.1\n    User u\n")  # TEST-NET
    code = cli.main(["-H", str(hostfile), "--ssh_config", str(config), "--dry-run",
                     "--include", include, script])
    out = capsys.readouterr().out
    assert code == 0
    assert f"far-a: ranks [0,1]  local ranks [0,1]  devices [{shown} the host has them" in out


def test_dry_run_of_remote_hosts_connects_to_nothing(tmp_path, capsys, script):
    hostfile = tmp_path / "hf"
    hostfile.write_text("far-a slots=2\nfar-b slots=1\n")
    config = tmp_path / "ssh_config"
    config.write_text("Host far-*\n    HostName 192.0.2.1\n    User u\n")  # TEST-NET
    code = cli.main(["-H", str(hostfile), "--ssh_config", str(config), "--dry-run",
                     "--num_nodes", "2", script])
    out = capsys.readouterr().out
    assert code == 0
    assert ("world size 3 on 2 node(s), master <address of far-a, found there at launch>:"
            "<free port chosen on far-a at launch>") in out
    assert "far-b: ranks [2]  local ranks [0]  devices [GPUs 0 if the host has them" in out
    assert "node far-a: ssh u@192.0.2.1:22: cd " in out
    assert "MASTER_PORT=<chosen at launch>" in out


def test_include_without_hostfile_on_a_cpu_host(tmp_path, capsys, script, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DSRUN_FAKE_GPUS", "0")
    monkeypatch.setattr("dsrun.launcher.hostfile.DEFAULT_JOB_HOSTFILE", str(tmp_path / "x"))
    monkeypatch.setattr("dsrun.launcher.cluster.usable_cpus", lambda: 4)
    # CPU ranks on the slots named (one per usable CPU), as DeepSpeed with
    # DS_ACCELERATOR=cpu runs them
    assert cli.main(["--dry-run", "--include", "localhost:0,2", script]) == 0
    assert "ranks [0,1]  local ranks [0,1]  devices [cpu]" in capsys.readouterr().out
    assert cli.main(["--dry-run", "--exclude", "localhost:3", script]) == 0
    assert "ranks [0,1,2]  local ranks [0,1,2]  devices [cpu]" in capsys.readouterr().out
    # naming slots beyond the CPUs oversubscribes, as --num_gpus 6 does
    assert cli.main(["--dry-run", "--include", "localhost:0,5", script]) == 0
    assert "ranks [0,1]  local ranks [0,1]  devices [cpu]" in capsys.readouterr().out
    assert cli.main(["--dry-run", "--include", "localhost", "--num_gpus", "6", script]) == 0
    assert "ranks [0,1,2,3,4,5]  local" in capsys.readouterr().out
    code, err = _main_err(capsys, ["--include", "localhost:1024", script])
    assert code == 2 and "slot 1024 is out of range for host" in err[0]


def test_one_machine_listed_twice_is_refused_naming_both():
    from dsrun.launcher.preflight import same_machines

    facts = [{**FACTS, "host": "node2", "machine": "boot1/node2"},
             {**FACTS, "host": "node3", "machine": "boot1/node3"},
             {**FACTS, "host": "node2", "machine": "boot1/node2"},
             None,                      # no answer: its own error says why
             {**FACTS, "host": "node2"}]  # an older agent: not compared
    problems = same_machines(["node2", "node3", "10.0.0.12", "node4", "old"], facts)
    assert problems == {2: "node2 and 10.0.0.12 in the hostfile are the same machine "
                           "(host name node2); list it once"}


def test_a_script_missing_on_a_host_fails_its_preflight():
    report = evaluate("n2", {**FACTS, "script": "does not exist", "cwd": "/w"}, None, EXPECT,
                      (0,), "worker", MASTER, script="train.py")
    assert not report.ok(strict=False)
    assert report.errors == ("script 'train.py' does not exist on n2 (in /w)",)
    ok = evaluate("n2", {**FACTS, "script": None}, None, EXPECT, (0,), "worker", MASTER,
                  script="train.py")
    assert ok.ok()


def test_a_loopback_master_addr_with_another_host_is_refused(tmp_path, capsys, script,
                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    hostfile = tmp_path / "hf"
    hostfile.write_text("localhost slots=1\nfar-a slots=1\n")
    for command in (["--dry-run"], ["doctor"]):
        for addr in ("127.0.0.1", "localhost", "::1"):
            argv = [*command, "-H", str(hostfile), "--cpu", "--master_addr", addr]
            code, err = _main_err(capsys, argv + ([script] if command[0] != "doctor" else []))
            assert code == 2 and err == [
                f"dsrun: error: --master_addr {addr} is this machine's loopback, but the job "
                f"runs on 2 hosts: the ranks on far-a would dial their own machine, not the "
                f"master; give an address of localhost that the other hosts reach, or leave "
                f"--master_addr out"]
    # one host: loopback is right
    argv = ["--dry-run", "-H", str(hostfile), "--include", "localhost", "--cpu",
            "--master_addr", "127.0.0.1", script]
    assert cli.main(argv) == 0


def test_doctor_takes_the_jobs_command_line_and_checks_its_script(tmp_path, capsys,
                                                                   monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("dsrun.launcher.hostfile.DEFAULT_JOB_HOSTFILE", str(tmp_path / "x"))
    code, err = _main_err(capsys, ["doctor", "--cpu", "--log_dir", "logs", "missing.py",
                                   "--lr", "1"])
    assert code == 2 and err == ["dsrun: error: script 'missing.py' does not exist"]
    ctx = cli.doctor_command.make_context(
        "dsrun doctor", ["--num_gpus", "1", "--max_restarts", "2", "t.py", "--num_gpus", "3"])
    assert ctx.params["script"] == "t.py" and ctx.params["script_args"] == ("--num_gpus", "3")
    assert cli.hosts_spec_from_params(ctx.params).num_gpus == 1
