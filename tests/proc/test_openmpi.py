"""``--launcher openmpi`` and MPI rank discovery with real mpirun processes (this host).

Every test runs its job with a unique tag in the environment, which mpirun,
the agents, the ranks and what they start all inherit; the ``job_tag``
fixture fails the test if any tagged process is left afterwards.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tests.conftest import ROOT, WORKERS, run_dsrun, start_dsrun, wait_for_pids, wait_gone

pytestmark = [pytest.mark.proc,
              pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed")]
BEHAVE = str(WORKERS / "behave.py")
PI_DIR = ROOT / "examples" / "mpi_pi"
CPU = ["--cpu"]  # ranks of these tests are CPU ranks (gloo), also on a GPU host
MPIRUN_ROOT = ["--allow-run-as-root"] if os.geteuid() == 0 else []


def tagged(tag: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("DSRUN_TEST_TAG") == tag and \
                    proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


@pytest.fixture
def job_tag():
    tag = uuid.uuid4().hex
    yield tag
    deadline = time.monotonic() + 5
    left = tagged(tag)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = tagged(tag)
    for proc in left:
        proc.kill()
    assert not left, "processes of the job left: " + "; ".join(
        f"{p.pid} {' '.join(p.cmdline())}" for p in left if p.is_running())


def _env(tag: str, **extra: str) -> dict[str, str]:
    return {"DSRUN_TEST_TAG": tag, **extra}


def test_allreduce_under_openmpi(job_tag):
    res = run_dsrun("--launcher", "openmpi", *CPU, "--num_gpus", "2",
                    str(WORKERS / "allreduce.py"), env=_env(job_tag), timeout=120)
    assert res.returncode == 0, res.stderr
    for rank in (0, 1):
        assert re.search(rf"^\[[^:\]]+:{rank}\] rank {rank}/2 backend gloo sum 3$",
                         res.stdout, re.M), res.stdout


def test_mpirun_by_hand_with_init_distributed(job_tag):
    argv = ["mpirun", *MPIRUN_ROOT, "--oversubscribe", "-np", "2", sys.executable,
            str(WORKERS / "init_distributed.py")]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=str(ROOT),
                         env={**os.environ, **_env(job_tag)})
    assert res.returncode == 0, res.stdout + res.stderr
    assert sorted(re.findall(r"rank (\d)/2 from Open MPI sum 3", res.stdout)) == ["0", "1"]
    # exported after the discovery, as DeepSpeed's init_distributed does
    for rank in (0, 1):
        assert re.search(rf"^rank {rank} environ RANK={rank} LOCAL_RANK={rank} WORLD_SIZE=2 "
                         rf"MASTER_ADDR=127\.0\.0\.1 MASTER_PORT=\d+$", res.stdout, re.M), \
            res.stdout


def test_rank_failure_under_mpirun_propagates_and_leaves_nothing(job_tag, pid_dir):
    res = run_dsrun("--launcher", "mpirun", *CPU, "--num_gpus", "2", "--dist_backend", "none",
                    "--kill_grace", "1", BEHAVE, "--pid_dir", str(pid_dir), "--fail_rank", "1",
                    "--code", "7", "--grandchild", "setsid", env=_env(job_tag), timeout=60)
    assert res.returncode == 7, res.stderr
    assert re.search(r"job failed: rank 1 on host \S+ failed first: exit code 7", res.stderr)
    assert "rank 1 exiting with 7" in res.stderr  # the output tail
    assert "1 other rank(s) stopped as a consequence" in res.stderr
    assert "[mpirun]" not in res.stderr  # mpirun itself saw clean exits
    pids = wait_for_pids(pid_dir, 4, 1)  # 2 ranks and their setsid grandchildren
    assert wait_gone(list(pids.values()), 3) == []


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGKILL, -9)])
def test_signal_to_dsrun_under_openmpi_leaves_nothing(job_tag, pid_dir, sig, code):
    proc = start_dsrun("--launcher", "openmpi", *CPU, "--num_gpus", "2", "--dist_backend", "none",
                       "--kill_grace", "1", BEHAVE, "--pid_dir", str(pid_dir),
                       "--grandchild", "setsid", env=_env(job_tag))
    try:
        pids = wait_for_pids(pid_dir, 4, 30)
        proc.send_signal(sig)
        proc.wait(timeout=20)
        # SIGKILL: the agents see their connection close and stop the ranks.
        assert wait_gone(list(pids.values()), 8) == []
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == code


def _pi_error(text: str) -> float:
    match = re.search(r"pi ~ ([0-9.]+), error ([0-9.e+-]+)", text)
    assert match, text
    assert abs(float(match.group(1)) - math.pi) == pytest.approx(float(match.group(2)),
                                                                 rel=1e-3)
    return float(match.group(2))


def test_pi_manager_and_workers_under_dsrun_openmpi_and_mpirun(job_tag):
    args = [str(PI_DIR / "pi.py"), "--workers", "2", "--samples", "4000000"]
    res = run_dsrun("--launcher", "openmpi", *CPU, "--num_gpus", "1", "--dist_backend", "none",
                    "--launcher_args=--oversubscribe", *args, env=_env(job_tag), timeout=120)
    assert res.returncode == 0, res.stderr
    assert _pi_error(res.stdout) < 1e-3 and "[mpirun]" not in res.stderr
    direct = subprocess.run(["mpirun", *MPIRUN_ROOT, "--oversubscribe", "-np", "1",
                             sys.executable, *args], capture_output=True, text=True,
                            timeout=120, cwd=str(ROOT), env={**os.environ, **_env(job_tag)})
    assert direct.returncode == 0, direct.stderr
    assert _pi_error(direct.stdout) == _pi_error(res.stdout)  # same seed, same shares


@pytest.mark.parametrize("launcher", ["local", "openmpi"])
def test_torch_pi_under_every_local_launcher(job_tag, launcher):
    res = run_dsrun("--launcher", launcher, *CPU, "--num_gpus", "2", str(PI_DIR / "pi_torch.py"),
                    "--samples", "4000000", env=_env(job_tag), timeout=120)
    assert res.returncode == 0, res.stderr
    assert _pi_error(res.stdout) < 1e-3
    assert "2 rank(s)" in res.stdout


# -- the same rank environment through every backend ----------------------------------


def _rank_env(stdout: str) -> dict[str, list[str]]:
    """rank -> its variable lines; the random job id and the name of the
    environment the agent starts in left out."""
    out: dict[str, list[str]] = {}
    current = None
    for line in stdout.splitlines():
        if line.startswith("  rank "):
            current = line.split(":", 1)[0].strip()
            out[current] = []
        elif line.startswith("    ") and current and "=" in line:
            # what layer 1 is called differs by backend; the variables may not
            text = line.strip().split(" (unless set in ")[0]
            text = re.sub(r" in front of the PATH of .*>$", " in front of the PATH>", text)
            out[current].append(re.sub(r"^DSRUN_JOB_ID=\w+", "DSRUN_JOB_ID=<id>", text))
    return out


def _dry(tmp_path: Path, hostfile: str, launcher: str, *extra: str) -> dict[str, list[str]]:
    hf = tmp_path / f"hostfile-{launcher}"
    hf.write_text(hostfile)
    res = run_dsrun("--dry-run", "-H", str(hf), "--launcher", launcher, *CPU, "--env", "SECRET=x",
                    "--dist_backend", "gloo", *extra, str(WORKERS / "allreduce.py"),
                    env={"NCCL_DEBUG": "INFO"})
    assert res.returncode == 0, res.stderr
    return _rank_env(res.stdout)


def test_dry_runs_show_the_same_rank_environment(tmp_path):
    local = {name: _dry(tmp_path, "localhost slots=2\n", name)
             for name in ("local", "ssh", "openmpi")}
    assert len(local["local"]) == 2 and "RANK=1" in local["local"]["rank 1 (local 1)"]
    assert local["local"] == local["ssh"] == local["openmpi"]
    config = tmp_path / "ssh_config"
    config.write_text("Host far-*\n    HostName 192.0.2.1\n")  # TEST-NET: never reached
    remote = {name: _dry(tmp_path, "far-a slots=2\nfar-b slots=1\n", name,
                         "--ssh_config", str(config)) for name in ("ssh", "openmpi")}
    assert remote["ssh"] == remote["openmpi"]
    assert "NCCL_DEBUG=<value not shown> (forwarded)" in remote["ssh"]["rank 2 (local 0)"]


def _shell_rank(launcher: str, env: dict[str, str]) -> list[str]:
    res = run_dsrun("--launcher", launcher, *CPU, "--num_gpus", "1", "--no_python", "sh", "-c",
                    'echo "PATH=$PATH LD_LIBRARY_PATH=${LD_LIBRARY_PATH-unset}"; python3',
                    env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    return [line.split("] ", 1)[1] for line in res.stdout.splitlines()]


def test_a_ranks_path_under_openmpi_is_the_one_under_local(job_tag, tmp_path):
    """mpirun run by its absolute path put /usr/bin (its
    prefix) before an activated venv on every rank's PATH, and /usr/lib in
    LD_LIBRARY_PATH: the venv's python3 was shadowed in the ranks."""
    venv = tmp_path / "venv-bin"
    venv.mkdir()
    (venv / "python3").write_text("#!/bin/sh\necho venv python3\n")
    (venv / "python3").chmod(0o755)
    env = _env(job_tag, PATH=f"{venv}{os.pathsep}{os.environ['PATH']}", LD_LIBRARY_PATH="")
    local = _shell_rank("local", env)
    assert local[1] == "venv python3", local
    assert _shell_rank("openmpi", env) == local


# -- bad input: one error, exit 2, nothing started --------------------------------------


def _fake_bin(tmp_path: Path, name: str, text: str) -> str:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    path = bindir / name
    path.write_text(f"#!/bin/sh\necho '{text}'\n")
    path.chmod(0o755)
    return str(bindir)


@pytest.mark.parametrize("case", ["no mpirun", "mpich", "no mpi4py", "bad launcher",
                                  "too many ranks", "launcher_args places ranks"])
def test_bad_input_is_one_error_and_nothing_starts(tmp_path, job_tag, case):
    args = ["--launcher", "openmpi", *CPU, "--dist_backend", "none", BEHAVE]
    env = _env(job_tag)
    expected = {
        "no mpirun": "mpirun is not on PATH; install Open MPI",
        "mpich": "is not Open MPI's mpirun (its --version says 'HYDRA build details:')",
        "no mpi4py": "mpi4py cannot be used by",
        "bad launcher": "--launcher 'opnmpi' does not exist; choose one of local, mpirun "
                        "(= openmpi), openmpi, pdsh (= ssh), slurm, ssh",
        "too many ranks": "--num_gpus 3 asks for more slots than available",
        "launcher_args places ranks": "--launcher_args: '-np' decides where ranks run",
    }[case]
    if case == "no mpirun":
        env["PATH"] = str(tmp_path)
    elif case == "mpich":
        env["PATH"] = _fake_bin(tmp_path, "mpirun", "HYDRA build details:") + ":/usr/bin:/bin"
    elif case == "no mpi4py":
        fake = tmp_path / "fake" / "mpi4py"
        fake.mkdir(parents=True)
        (fake / "__init__.py").write_text("raise ImportError('mpi4py broken on purpose')\n")
        env["PYTHONPATH"] = str(tmp_path / "fake")
    elif case == "bad launcher":
        args[1] = "opnmpi"
    elif case == "too many ranks":
        hf = tmp_path / "hf"
        hf.write_text("localhost slots=2\n")
        args = ["-H", str(hf), "--num_gpus", "3", *args]
    else:
        args = ["--launcher_args", "-np 4", *args]
    res = run_dsrun(*args, env=env)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dsrun: error: ") and expected in lines[0], \
        lines
    assert res.stdout == ""


def test_mpirun_failing_before_the_agents_connect_is_named(job_tag):
    res = run_dsrun("--launcher", "openmpi", *CPU, "--dist_backend", "none",
                    "--launcher_args", "--no-such-mpirun-option", BEHAVE, env=_env(job_tag))
    assert res.returncode == 1, res.stderr
    assert res.stderr.strip().splitlines()[-1] == (  # mpirun runs by name: no path here
        "dsrun: error: mpirun exited with status 1 before the agents of rank(s) 0,1 connected "
        "back: mpirun: Error: unknown option \"--no-such-mpirun-option\"")
    assert "[mpirun] " in res.stderr  # its own lines, as they came


def test_doctor_through_mpirun(job_tag):
    res = run_dsrun("doctor", "--launcher", "openmpi", *CPU, env=_env(job_tag), timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "(launcher: openmpi," in res.stdout and "all 1 host(s) ok" in res.stdout
    assert "master 127.0.0.1:" in res.stdout and "(port free, held)" in res.stdout
