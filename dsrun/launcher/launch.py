"""The body of ``dsrun run``: spec -> plan -> backend -> supervise -> exit code.

All validation that can fail happens before any process starts. This module
and cli.py are the only launcher modules that write to the console.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import signal
import socket
import sys
import uuid
from collections.abc import Callable

import click

from dsrun.errors import DsrunUsageError
from dsrun.launcher.backends import get_backend
from dsrun.launcher.devices import usable_cpus, visible_devices
from dsrun.launcher.plan import LaunchPlan, describe, layout, local_slots, rank_command
from dsrun.launcher.report import JobResult, report_lines
from dsrun.launcher.spec import LaunchSpec
from dsrun.launcher.supervisor import Interrupted, Supervisor, raise_interrupted

LOCAL_MASTER = "127.0.0.1"


def say(message: str) -> None:
    click.echo(f"dsrun: {message}", err=True)


def check_script(spec: LaunchSpec) -> None:
    if spec.module:
        return
    if spec.no_python and os.sep not in spec.script and shutil.which(spec.script):
        return
    if not os.path.exists(spec.script):
        raise DsrunUsageError(f"script {spec.script!r} does not exist")
    if not os.path.isfile(spec.script):
        raise DsrunUsageError(f"script {spec.script!r} is not a file")
    if spec.no_python and not os.access(spec.script, os.X_OK):
        raise DsrunUsageError(f"--no_python: {spec.script!r} is not executable")


def free_port(addr: str) -> int:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])


def check_port(addr: str, port: int) -> None:
    """Fail if an explicitly given port is taken on this host."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # TCPStore binds with SO_REUSEADDR too: TIME_WAIT leftovers are fine.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise DsrunUsageError(
                    f"--master_port {port} is already in use on {addr}") from None
            if exc.errno != errno.EADDRNOTAVAIL:  # not an address of this host
                raise DsrunUsageError(f"cannot bind {addr}:{port}: {exc.strerror}") from None


def check_log_dir(path: str | None) -> None:
    if path is None:
        return
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise DsrunUsageError(f"--log_dir {path!r}: {exc.strerror}") from None
    if not os.access(path, os.W_OK):
        raise DsrunUsageError(f"--log_dir {path!r} is not writable")


def make_plan(spec: LaunchSpec, devices: tuple[int, ...], cpus: int,
              port_for: Callable[[str], int] = free_port) -> LaunchPlan:
    """Pure apart from the port choice: the plan for a single-host job."""
    node = local_slots(spec.num_gpus, devices, cpus, socket.gethostname())
    addr = spec.master_addr or LOCAL_MASTER
    port = spec.master_port if spec.master_port is not None else port_for(addr)
    job_env = dict(spec.extra_env)
    if spec.dist_backend is not None:
        job_env["DSRUN_DIST_BACKEND"] = spec.dist_backend
    return LaunchPlan(
        job_id=uuid.uuid4().hex,
        nodes=layout([node]),
        master_addr=addr,
        master_port=port,
        command=rank_command(spec, sys.executable),
        job_env=tuple(sorted(job_env.items())),
        cwd=os.getcwd(),
        kill_grace=spec.kill_grace,
        log_dir=os.path.abspath(spec.log_dir) if spec.log_dir else None,
    )


def run(spec: LaunchSpec) -> int:
    check_script(spec)
    if spec.master_port is not None:
        check_port(spec.master_addr or LOCAL_MASTER, spec.master_port)
    devices = visible_devices()
    plan = make_plan(spec, devices, usable_cpus())
    if not devices:
        say(f"no GPUs on this host: starting {plan.world_size} CPU rank(s) with gloo "
            f"(--num_gpus counts CPU ranks here)")
    backend = get_backend(spec.backend)
    if spec.dry_run:
        request = backend.prepare(plan)
        for line in describe(plan) + request.describe():
            click.echo(line)
        return 0
    check_log_dir(spec.log_dir)
    for line in describe(plan):
        say(line)
    return _run_attempts(spec, plan, backend)


def _run_attempts(spec: LaunchSpec, plan: LaunchPlan, backend) -> int:
    previous = {s: signal.signal(s, raise_interrupted)
                for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        for attempt in range(spec.max_restarts + 1):
            result = _attempt(plan, backend)
            if result.exit_code == 0 or result.interrupted is not None:
                break
            if attempt < spec.max_restarts:
                cause = result.root_cause
                say(f"attempt {attempt + 1} failed ({cause.cause() if cause else 'unknown'} "
                    f"on rank {cause.rank if cause else '?'}); restarting "
                    f"({attempt + 1}/{spec.max_restarts})")
                port = spec.master_port or free_port(plan.master_addr)
                plan = dataclasses.replace(plan, restart_count=attempt + 1, master_port=port)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    for line in report_lines(result):
        say(line)
    if result.interrupted is not None:
        say(f"stopped by {signal.Signals(result.interrupted).name}; every rank was stopped")
    return result.exit_code


def _attempt(plan: LaunchPlan, backend) -> JobResult:
    request = backend.prepare(plan)
    try:
        handle = backend.launch(request)
    except Interrupted as exc:
        return JobResult(interrupted=exc.signum)
    hosts = [a.host for a in request.agents]
    return Supervisor(handle, hosts, _print_line, plan.kill_grace).run()


def _print_line(host: str, rank: int, fd: int, line: str) -> None:
    stream = sys.stdout if fd == 1 else sys.stderr
    stream.write(f"[{host}:{rank}] {line}\n")
    stream.flush()
