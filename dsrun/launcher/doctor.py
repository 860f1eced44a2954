"""``dsrun doctor``: check every selected host before a launch, one line per host.

The same hosts, backend, agents and probe as a launch (cluster.py), with
the verdicts of preflight.py and nothing started: every host's agent
reports its facts and exits. The agents start as a launch's do, with the
job's environment (so with the ranks' PYTHONPATH: the same dsrun copy);
with the job's command line, its script and ``--log_dir`` files are checked
on every host too (and nothing is left of the check). Exits 0 when every host passes, else 1
naming the failing hosts.

This host's TMPDIR is checked too, where a job starts a node agent here
(:func:`tmpdir_problem`): a TMPDIR that is missing, not a directory or not
writable is warned of with its fix. The agent makes its temporary
directory (the ranks' error and stack files) there; it passes over an
unusable one to TEMP, TMP, /tmp (as the ranks' ``tempfile`` does), so
this is a warning, not a failed host.
"""

from __future__ import annotations

import os
import shlex
import signal
import tempfile
import uuid
from collections.abc import Mapping

import click

from dsrun.launcher.cluster import check_master, here_facts, probe_cluster, resolve_cluster
from dsrun.launcher.plan import build_plan
from dsrun.launcher.preflight import PreflightFailed
from dsrun.launcher.spec import HostsSpec, LaunchSpec


def tmpdir_problem(environ: Mapping[str, str]) -> str | None:
    """Why ``environ``'s TMPDIR cannot hold the node agent's temporary
    directory, with the fix; None when it can (or TMPDIR is not set)."""
    value = environ.get("TMPDIR")
    if not value:
        return None
    full = os.path.abspath(value)
    shown = f"TMPDIR={value}" + (f" ({full})" if full != value else "")
    quoted = shlex.quote(full)
    if not os.path.exists(full):
        why, fix = "does not exist", f"create it (mkdir -p {quoted})"
    elif not os.path.isdir(full):
        why, fix = "is not a directory", "point TMPDIR at a directory"
    else:
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".dsrun-doctor-", dir=full))
            return None
        except OSError as exc:
            why = f"cannot be written ({exc.strerror or exc})"
            fix = f"make it writable (chmod u+w {quoted}; or a read-only file system?)"
    return (f"{shown} {why}: the node agent on this host cannot make its temporary "
            f"directory there (it and the ranks' tempfile fall back to TEMP, TMP or /tmp); "
            f"fix: {fix}, or export TMPDIR=/tmp (or unset TMPDIR)")


def run_doctor(hs: HostsSpec, cwd: str, echo=click.echo,  # noqa: ANN001 - click.echo
               job: LaunchSpec | None = None) -> int:
    """``dsrun doctor``: one line per host; 0 when every host passes.
    ``job``: the job's whole command line was given; its script is checked
    here, as a launch checks it, and on every host by the probe."""
    from dsrun.launcher.launch import (
        check_script,
        log_files,
        probed_script,
        spans_hosts,
        user_env,
    )

    if job is not None:
        check_script(job)
    cluster, backend = resolve_cluster(hs, cwd)
    check_master(hs, cluster)
    echo(f"checking {len(cluster.hosts)} host(s) from {cluster.source} "
         f"(launcher: {cluster.launcher}, working directory {cwd})")
    # The agents need a plan to be started by mpirun/srun; it runs nothing.
    spec = LaunchSpec(script="<doctor>", num_gpus=hs.num_gpus, backend=hs.launcher,
                      ssh=hs.ssh, cpu=hs.cpu, launcher_args=hs.launcher_args,
                      slurm_args=hs.slurm_args)
    env = user_env(job or spec, cwd, remote=cluster.remote, multi_host=spans_hosts(cluster),
                   forward=cluster.remote and backend.login_env)  # as launch.run
    plan = build_plan(job or spec, cluster, env, uuid.uuid4().hex, facts=here_facts(cluster),
                      python=backend.python, cwd=os.getcwd())
    tmp = tmpdir_problem(os.environ) if any(node.local for node in plan.nodes) else None
    if tmp is not None:
        echo(f"  this host: warning: {tmp}")
    try:
        handle = backend.open(plan, lambda host, rank, fd, line: echo(f"  [{host}] {line}"))
        try:
            if not cluster.named:
                cluster = cluster.renamed([handle.channels[i].host for i in handle.leaders])
            outcome = probe_cluster(handle, cluster, backend, hs, versions=True,
                                    script=None if job is None else probed_script(job),
                                    log_files=log_files(plan))
        finally:
            handle.close()
    except KeyboardInterrupt:  # the connections are closed (ssh.py): say so, no traceback
        echo("dsrun doctor: interrupted (Ctrl-C) before every host answered", err=True)
        return 128 + signal.SIGINT
    for line in outcome.lines():
        echo(f"  {line}")
    failed = outcome.failed()
    if failed:
        names = ", ".join(r.host for r in failed)
        raise PreflightFailed(f"{len(failed)} of {len(cluster.hosts)} host(s) failed: {names}")
    echo(f"all {len(cluster.hosts)} host(s) ok ({outcome.seconds:.2f}s)")
    return 0
