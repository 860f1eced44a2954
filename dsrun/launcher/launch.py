"""The body of ``dsrun run``: spec -> plan -> backend -> supervise -> exit code.

All validation that can fail happens before any process starts. This module
and cli.py are the only launcher modules that write to the console.

Without a hostfile (or with one that selects only this host) the job is
local: one plan, the local backend. Otherwise each attempt connects to every
host (SSH; this host locally), probes them (doctor.py: the preflight, the
master address and port, each host's devices and interface), builds the
final plan from the answers, and only then sends the start payloads - so a
failed preflight starts no rank anywhere.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import signal
import socket
import sys
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import click

from dsrun.errors import DsrunUsageError
from dsrun.launcher.backends import get_backend
from dsrun.launcher.backends.base import Backend
from dsrun.launcher.devices import usable_cpus, visible_devices
from dsrun.launcher.doctor import (
    Cluster,
    PreflightFailed,
    Rendezvous,
    probe_cluster,
    resolve_cluster,
)
from dsrun.launcher.envpolicy import JobEnv, env_file_paths, job_env, read_env_files
from dsrun.launcher.netinfo import LOCAL_MASTER
from dsrun.launcher.plan import (
    LaunchPlan,
    command_fields,
    describe,
    host_slots,
    layout,
    local_slots,
    socket_env,
)
from dsrun.launcher.report import JobResult, report_lines
from dsrun.launcher.spec import LaunchSpec
from dsrun.launcher.supervisor import Interrupted, Supervisor, raise_interrupted


def say(message: str) -> None:
    click.echo(f"dsrun: {message}", err=True)


def check_config(spec: LaunchSpec) -> None:
    """--config must be a readable JSON object (its keys are checked in each rank)."""
    if spec.config is None:
        return
    try:
        with open(spec.config, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise DsrunUsageError(f"--config {spec.config!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise DsrunUsageError(f"--config {spec.config}:{exc.lineno}:{exc.colno}: not valid "
                              f"JSON: {exc.msg}") from None
    if not isinstance(data, dict):
        raise DsrunUsageError(f"--config {spec.config}: expected a JSON object, "
                              f"got {type(data).__name__}")


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


def user_env(spec: LaunchSpec, cwd: str, remote: bool) -> JobEnv:
    """The user's variables for the ranks (envpolicy.py): files, --env, forwarded."""
    files = read_env_files(env_file_paths(cwd, os.path.expanduser("~")))
    return job_env(os.environ, remote=remote, env_prefixes=spec.env_prefixes,
                   file_entries=files, cli_env=spec.extra_env)


def _job_env(spec: LaunchSpec) -> tuple[tuple[str, str], ...]:
    env = {}
    if spec.cpu:
        # The ranks see no GPU, so the runtime, torch and the script itself
        # all take the CPU path; DSRUN_ACCELERATOR says why.
        env["DSRUN_ACCELERATOR"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
    if spec.dist_backend is not None:
        env["DSRUN_DIST_BACKEND"] = spec.dist_backend
    if spec.config is not None:
        env["DSRUN_CONFIG"] = os.path.abspath(spec.config)
    return tuple(sorted(env.items()))


def make_plan(spec: LaunchSpec, devices: tuple[int, ...], cpus: int,
              port_for: Callable[[str], int] = free_port, *,
              slots: tuple[int, ...] | None = None, env: JobEnv | None = None) -> LaunchPlan:
    """Pure apart from the port choice: the plan for a single-host job.

    ``slots``: the hostfile slots selected on this host (None: no hostfile).
    """
    host = socket.gethostname()
    if spec.cpu:
        devices = ()
    if slots is None:
        node = local_slots(spec.num_gpus, devices, cpus, host)
    else:
        node = host_slots(host, slots, True, devices)
    addr = spec.master_addr or LOCAL_MASTER
    port = spec.master_port if spec.master_port is not None else port_for(addr)
    return LaunchPlan(
        job_id=uuid.uuid4().hex,
        nodes=layout([node]),
        master_addr=addr,
        master_port=port,
        **command_fields(spec, sys.executable),
        job_env=_job_env(spec),
        user_env=env if env is not None else job_env({}, remote=False,
                                                     cli_env=spec.extra_env),
        cwd=os.getcwd(),
        kill_grace=spec.kill_grace,
        log_dir=os.path.abspath(spec.log_dir) if spec.log_dir else None,
    )


def cluster_plan(spec: LaunchSpec, cluster: Cluster, env: JobEnv, job_id: str,
                 facts: Sequence[dict[str, Any] | None] | None = None,
                 master: Rendezvous | None = None, local_devices: tuple[int, ...] = (),
                 restart_count: int = 0, python: str | None = None) -> LaunchPlan:
    """The plan of a hostfile job over ``cluster`` (pure).

    Without ``facts`` (dry-run: nothing was probed) the plan is a draft:
    remote hosts' devices and the rendezvous are left open. With them,
    each host gets GPU or CPU ranks by its own devices, and the interface
    that routes to the master for gloo/NCCL (unless the user set it).
    """
    nodes = []
    for i, host in enumerate(cluster.hosts):
        host_facts = facts[i] if facts else None
        devices: Sequence[int] | None
        if spec.cpu:
            devices = ()
        elif host_facts is not None:
            devices = host_facts.get("devices") or ()
        else:
            devices = local_devices if cluster.local[i] else None
        ifname = host_facts.get("ifname") if host_facts and len(cluster.hosts) > 1 else None
        nodes.append(host_slots(host, cluster.slots[i], cluster.local[i], devices,
                                socket_env(ifname, env.keys())))
    return LaunchPlan(
        job_id=job_id,
        nodes=layout(nodes),
        master_addr=master.addr if master else spec.master_addr,
        master_port=master.port if master else spec.master_port,
        **command_fields(spec, python or sys.executable),
        job_env=_job_env(spec),
        user_env=env,
        cwd=os.getcwd(),
        kill_grace=spec.kill_grace,
        log_dir=os.path.abspath(spec.log_dir) if spec.log_dir else None,
        restart_count=restart_count,
    )


def run(spec: LaunchSpec) -> int:
    check_script(spec)
    check_config(spec)
    cwd = os.getcwd()
    resolved = resolve_cluster(spec.hosts, cwd)
    if resolved is None or resolved[0].launcher == "local":
        cluster = resolved[0] if resolved else None
        return _run_local(spec, cluster, user_env(spec, cwd, remote=False))
    cluster, backend = resolved
    return _run_cluster(spec, cluster, backend, user_env(spec, cwd, remote=cluster.remote))


def _run_local(spec: LaunchSpec, cluster: Cluster | None, env: JobEnv) -> int:
    if spec.master_port is not None:
        check_port(spec.master_addr or LOCAL_MASTER, spec.master_port)
    devices = () if spec.cpu else visible_devices()
    plan = make_plan(spec, devices, usable_cpus(), slots=cluster.slots[0] if cluster else None,
                     env=env)
    if spec.cpu:
        say(f"--cpu: starting {plan.world_size} CPU rank(s) with gloo "
            f"(--num_gpus counts CPU ranks)")
    elif not devices:
        say(f"no GPUs on this host: starting {plan.world_size} CPU rank(s) with gloo "
            f"(--num_gpus counts CPU ranks here)")
    backend = get_backend("local")
    if spec.dry_run:
        return _print_dry_run(plan, backend)
    check_log_dir(spec.log_dir)
    for line in describe(plan):
        say(line)

    def attempt(restart: int) -> JobResult:
        nonlocal plan
        if restart:
            port = spec.master_port or free_port(plan.master_addr or LOCAL_MASTER)
            plan = dataclasses.replace(plan, restart_count=restart, master_port=port)
        return _attempt(plan, backend)

    return _run_attempts(spec, attempt)


def _print_dry_run(plan: LaunchPlan, backend: Backend) -> int:
    request = backend.prepare(plan)
    for line in describe(plan) + request.describe():
        click.echo(line)
    return 0


def _run_cluster(spec: LaunchSpec, cluster: Cluster, backend: Backend, env: JobEnv) -> int:
    job_id = uuid.uuid4().hex
    draft = cluster_plan(spec, cluster, env, job_id, local_devices=visible_devices())
    if spec.dry_run:
        return _print_dry_run(draft, backend)
    check_log_dir(spec.log_dir)
    return _run_attempts(spec, lambda restart: _cluster_attempt(
        spec, cluster, backend, env, job_id, restart))


def _cluster_attempt(spec: LaunchSpec, cluster: Cluster, backend: Backend, env: JobEnv,
                     job_id: str, restart: int) -> JobResult:
    """Connect, probe (preflight), plan, start, supervise: one attempt."""
    handle = None
    try:
        handle = backend.open(cluster.hosts, os.getcwd(), cluster.local)
        outcome = probe_cluster(handle, cluster, backend, spec.hosts)
        failed = outcome.failed(strict=spec.preflight)
        if failed:
            width = max(len(r.host) for r in failed)
            for report in failed:
                say(report.line(width, strict=spec.preflight))
            names = ", ".join(r.host for r in failed)
            hint = "" if not spec.preflight else \
                " (`dsrun doctor` checks the hosts; --no_preflight skips version checks)"
            raise PreflightFailed(f"preflight failed on {names}: no rank was started{hint}")
        plan = cluster_plan(spec, cluster, env, job_id, outcome.facts, outcome.master,
                            restart_count=restart)
        say(f"preflight ok on {len(cluster.hosts)} host(s) in {outcome.seconds:.2f}s")
        if restart == 0:
            for line in describe(plan):
                say(line)
        request = backend.prepare(plan)
        handle.start([a.payload for a in request.agents])
    except Interrupted as exc:
        if handle is not None:
            handle.close()
        return JobResult(interrupted=exc.signum)
    except BaseException:
        if handle is not None:
            handle.close()
        raise
    return Supervisor(handle, list(cluster.hosts), _print_line, plan.kill_grace).run()


def _run_attempts(spec: LaunchSpec, attempt: Callable[[int], JobResult]) -> int:
    previous = {s: signal.signal(s, raise_interrupted)
                for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        for restart in range(spec.max_restarts + 1):
            result = attempt(restart)
            if result.exit_code == 0 or result.interrupted is not None:
                break
            if restart < spec.max_restarts:
                cause = result.root_cause
                say(f"attempt {restart + 1} failed ({cause.cause() if cause else 'unknown'} "
                    f"on rank {cause.rank if cause else '?'}); restarting "
                    f"({restart + 1}/{spec.max_restarts})")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    # After Ctrl-C, ranks killed by dsrun's own stop are not a failure to report.
    if result.interrupted is None or any(not f.during_stop for f in result.failures):
        for line in report_lines(result):
            say(line)
    if result.interrupted is not None:
        say(f"stopped by {signal.Signals(result.interrupted).name}; every rank was stopped")
    return result.exit_code


def _attempt(plan: LaunchPlan, backend: Backend) -> JobResult:
    request = backend.prepare(plan)
    try:
        handle = backend.launch(request)
    except Interrupted as exc:
        return JobResult(interrupted=exc.signum)
    hosts = [a.host for a in request.agents]
    return Supervisor(handle, hosts, _print_line, plan.kill_grace).run()


def _print_line(host: str, rank: int, fd: int, line: str) -> None:
    stream = sys.stdout if fd == 1 else sys.stderr
    who = rank if rank >= 0 else "agent"
    stream.write(f"[{host}:{who}] {line}\n")
    stream.flush()
