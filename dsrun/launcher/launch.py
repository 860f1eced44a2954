"""The body of ``dsrun run``: spec -> hosts -> plan -> backend -> supervise -> exit code.

One launch path for every backend (local, ssh, openmpi, slurm) and every
job size. All validation that can fail happens before any process starts
(script, config, hosts, the backend's own checks). Then each attempt:

1. open: the backend starts one agent per host (or per rank, for mpirun
   and srun), each waiting for its first line;
2. probe: the first agent of each host reports its facts; the master's
   agent picks the rendezvous address and holds a free port until its ranks
   start (on every path: no bind-and-release race); multi-host jobs get the
   preflight verdicts, and a failed preflight starts no rank anywhere;
3. plan: the one plan builder (plan.py) over the probed facts;
4. start: each agent gets its part of the plan;
5. supervise until every agent is done; one root-cause report;
6. finish the output (output_end.py): stderr at once, stdout as long as
   its reader takes something (a few seconds at most after a signal
   stopped the job), with the job's signal handling still in force; the
   exit code is the job's.

``--dry-run`` prints the draft plan (what is known before any host is
asked) through the same builder and the backend's request. Both it and the
start banner name the hostfile the job uses (or say there is none). A
``--config`` is validated in full (configcheck.py) before either. While a
job runs, its control socket (control.py) answers ``dsrun stack``. This
module, console.py, output_end.py and cli.py are the only launcher
modules that write to the console.
"""

from __future__ import annotations

import os
import signal
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace

import click

from dsrun.errors import DsrunUsageError
from dsrun.launcher import output_end
from dsrun.launcher.backends.base import Backend, JobHandle
from dsrun.launcher.cluster import (
    Cluster,
    ProbeOutcome,
    check_master,
    describe_source,
    here_facts,
    probe_cluster,
    resolve_cluster,
)
from dsrun.launcher.configcheck import check_config
from dsrun.launcher.console import Console
from dsrun.launcher.control import ControlServer
from dsrun.launcher.envpolicy import (
    JobEnv,
    check_ds_env_file,
    env_file_paths,
    job_env,
    read_env_files,
    unapplied_env_files,
)
from dsrun.launcher.jobsignals import (
    release_signals,
    suspension,
    take_signals,
)
from dsrun.launcher.launch_checks import check_log_dir, check_script, log_files, probed_script
from dsrun.launcher.output_end import DEFAULT_OUTPUT_WAIT, OUTPUT_WAIT_VAR
from dsrun.launcher.plan import LaunchPlan, build_plan, describe
from dsrun.launcher.preflight import HostReport, PreflightFailed
from dsrun.launcher.rankenv import check_user_env, torchelastic_env
from dsrun.launcher.report import (
    JobResult,
    report_lines,
    restartable,
    sigkill_lines,
    unconfirmed_lines,
)
from dsrun.launcher.spec import LaunchSpec, check_seconds, cpu_by_deepspeed_variable
from dsrun.launcher.stop_failures import stopped_line
from dsrun.launcher.supervisor import SIGNALS, Interrupted, Supervisor, Watch
from dsrun.launcher.watch import DEFAULT_STRAGGLER_INTERVAL

#: Seconds before the first "still running" line once some ranks have exited.
STRAGGLER_VAR = "DSRUN_STRAGGLER_INTERVAL"

console = Console()


def say(message: str) -> None:
    console.say(message)


def user_env(spec: LaunchSpec, cwd: str, remote: bool, multi_host: bool,
             forward: bool | None = None) -> JobEnv:
    """The user's variables for the ranks (envpolicy.py): files, --env, forwarded.
    DeepSpeed's env files only for a ``multi_host`` job (:func:`spans_hosts`).
    A ``remote`` job (a host that is not this one) gets ``cwd`` first on its
    ranks' PYTHONPATH, as DeepSpeed's multi-node runner gives them, whatever
    the backend. ``forward``: whether the launcher's variables are forwarded
    (default ``remote``; False where the backend passes its whole
    environment on, as srun does: :attr:`Backend.login_env`)."""
    home = os.path.expanduser("~")
    if multi_host:
        check_ds_env_file(cwd, home, os.environ)
    files = read_env_files(env_file_paths(cwd, home, os.environ, multi_host=multi_host))
    return job_env(os.environ, remote=remote if forward is None else forward,
                   env_prefixes=spec.env_prefixes, file_entries=files, cli_env=spec.extra_env,
                   cwd_first=cwd if remote else None)


def spans_hosts(cluster: Cluster) -> bool:
    """Whether a job takes DeepSpeed's env files: it runs on more than one
    host, or on one that is not this one (DeepSpeed's multi-node path, which
    it takes for several hosts or --force_multi)."""
    return len(cluster.hosts) > 1 or cluster.remote


def env_files_note(cwd: str, multi: bool) -> str | None:
    """One line naming DeepSpeed's env files that a job on this host alone
    does not apply (None: there are none, or the job applies them)."""
    unapplied = [] if multi else \
        unapplied_env_files(cwd, os.path.expanduser("~"), os.environ)
    if not unapplied:
        return None
    return (f"env file {', '.join(unapplied)} not applied: DeepSpeed's env files apply only "
            f"to jobs on several hosts or on another host, as in DeepSpeed (./.dsrun_env or "
            f"--env sets variables for a job on this host)")


def _plan(spec: LaunchSpec, cluster: Cluster, backend: Backend, env: JobEnv, job_id: str,
          restart: int, outcome: ProbeOutcome | None = None) -> LaunchPlan:
    """The plan of an attempt: a draft (nothing probed) or the final one."""
    facts = outcome.node_facts() if outcome is not None else here_facts(cluster)
    master = (outcome.master.addr, outcome.master.port) if outcome is not None else None
    plan = build_plan(spec, cluster, env, job_id, facts=facts, python=backend.python,
                      cwd=os.getcwd(), master=master, restart_count=restart,
                      remote_path=backend.remote_path())
    return replace(plan, job_env=torchelastic_env(plan.job_env, restart, spec.max_restarts))


def cpu_ranks_line(spec: LaunchSpec, cluster: Cluster, draft: LaunchPlan) -> None:
    """Say that the job's ranks are CPU ranks, when they are, and which backend
    they use (gloo unless --dist_backend names one)."""
    how = {None: "with gloo", "none": "without a process group"}.get(
        spec.dist_backend, f"with {spec.dist_backend}")
    if spec.cpu:
        why = "DS_ACCELERATOR=cpu" if cpu_by_deepspeed_variable(os.environ) else "--cpu"
        say(f"{why}: starting {draft.world_size} CPU rank(s) {how} "
            f"(--num_gpus counts CPU ranks)")
    elif not cluster.remote and cluster.named and not any(n.devices for n in draft.nodes):
        say(f"no GPUs on this host: starting {draft.world_size} CPU rank(s) {how} "
            f"(--num_gpus counts CPU ranks here)")


def working_directory() -> str:
    """The launcher's working directory, or a usage error when it was
    deleted (every host's ranks run in it)."""
    try:
        return os.getcwd()
    except FileNotFoundError:
        where = os.environ.get("PWD")
        named = f"the working directory {where}" if where else "the working directory"
        raise DsrunUsageError(f"{named} no longer exists (deleted after the shell entered "
                              f"it): cd to an existing directory") from None


def run(spec: LaunchSpec) -> int:
    cwd = working_directory()
    check_script(spec)
    straggler_interval(os.environ)  # a bad value is an error before anything starts
    patience = output_wait(os.environ)
    cluster, backend = resolve_cluster(spec.hosts, cwd)
    check_master(spec.hosts, cluster)
    multi = spans_hosts(cluster)
    # srun passes the whole environment (no forwarding), but a Slurm job on other
    # hosts gets the working directory first on PYTHONPATH as an ssh job does
    env = user_env(spec, cwd, remote=cluster.remote, multi_host=multi,
                   forward=cluster.remote and backend.login_env)
    job_id = uuid.uuid4().hex
    draft = _plan(spec, cluster, backend, env, job_id, 0)
    check_user_env(draft)
    if spec.config is not None:
        warning = check_config(spec.config, draft.world_size,
                               {**os.environ, **dict(spec.extra_env)})
        if warning:
            say(warning)
    source = describe_source(spec.hosts, cluster, cwd)
    note = env_files_note(cwd, multi)
    if spec.dry_run:
        for line in [source, *([note] if note else []), *describe(draft),
                     *backend.prepare(draft).describe()]:
            click.echo(line)
        return 0
    check_log_dir(spec.log_dir)
    say(source)
    if note:
        say(note)
    cpu_ranks_line(spec, cluster, draft)
    return _run_job(spec, cluster, backend, env, job_id, draft.world_size, patience)


def _run_job(spec: LaunchSpec, cluster: Cluster, backend: Backend, env: JobEnv, job_id: str,
             world_size: int, patience: float | None) -> int:
    """Every attempt of the job, its report and the end of its output."""
    began = time.monotonic()
    control = ControlServer(job_id, lambda: {
        "job_id": job_id, "pid": os.getpid(), "script": spec.script,
        "hosts": list(cluster.hosts), "ranks": world_size,
        "seconds": time.monotonic() - began}).start()
    clock = JobClock()
    previous = take_signals()  # in force until the console is closed
    console.start_writer()  # no reporter waits for dsrun's stdout from here on
    ended = 0
    try:
        try:
            code = _run_attempts(spec, lambda restart: _attempt(
                spec, cluster, backend, env, job_id, restart, control, clock), clock)
        finally:
            SIGNALS.hold()  # from here a signal is only recorded, for finish_output
            ended = SIGNALS.received
            control.close()
            finish_output(patience, SIGNALS.first if ended else None)
            broken = console.close(wait=False)
    finally:
        release_signals(previous, ended)
    failure = console.failure  # a full disk, a file size limit: said by cli.py
    if failure is not None:
        failure.job_code = code
        raise failure
    if broken:  # a closed pipe took the last lines (`dsrun ... | head`)
        raise BrokenPipeError("dsrun's output stream is closed")
    return code


def _seconds_var(environ: Mapping[str, str], name: str, default: float) -> float | None:
    """The seconds an environment variable gives (``default`` when unset;
    0: ``None``, no limit), or a usage error naming it."""
    text = environ.get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise DsrunUsageError(f"{name}={text!r} is not a number of seconds") from None
    check_seconds(f"{name} (environment)", value, zero=True)
    return value if value > 0 else None


def straggler_interval(environ: Mapping[str, str]) -> float | None:
    """Seconds before the first "still running" line (``DSRUN_STRAGGLER_INTERVAL``;
    0: never), or a usage error for a value that is not a number of seconds."""
    return _seconds_var(environ, STRAGGLER_VAR, DEFAULT_STRAGGLER_INTERVAL)


def output_wait(environ: Mapping[str, str]) -> float | None:
    """Seconds the ended job's stdout waits for a reader that takes nothing
    (``DSRUN_OUTPUT_WAIT``; 0: as long as it takes), or a usage error."""
    return _seconds_var(environ, OUTPUT_WAIT_VAR, DEFAULT_OUTPUT_WAIT)


def finish_output(patience: float | None, stopped_by: int | None = None) -> None:
    """Write what the console holds once the job has ended (output_end.py)."""
    output_end.finish_output(console, patience, stopped_by)


class JobClock:
    """When the job's --timeout started counting: when the first attempt's
    ranks were started (a restart does not reset it)."""

    def __init__(self) -> None:
        self.started: float | None = None

    def left(self, timeout: float | None) -> float | None:
        """Seconds of --timeout left (None: no timeout, or not started)."""
        if timeout is None or self.started is None:
            return None
        return timeout - (time.monotonic() - self.started)


def _watch(spec: LaunchSpec, control: ControlServer, started: float) -> Watch:
    return Watch(timeout=spec.timeout, started=started,
                 heartbeat_timeout=spec.heartbeat_timeout,
                 straggler_interval=straggler_interval(os.environ),
                 queries=control.queries, say=say, job_id=control.job_id,
                 on_started=console.started, output_backlog=console.pending)


def _attempt(spec: LaunchSpec, cluster: Cluster, backend: Backend, env: JobEnv,
             job_id: str, restart: int, control: ControlServer, clock: JobClock) -> JobResult:
    """Open, probe (preflight), plan, start, supervise: one attempt."""
    handle: JobHandle | None = None
    multi = cluster.remote or len(cluster.hosts) > 1
    try:
        SIGNALS.arm()  # a signal aborts the start; from hold() on, the supervisor reads them
        draft = _plan(spec, cluster, backend, env, job_id, restart)
        if multi:
            console.start_progress(len(draft.nodes) if not backend.agent_per_rank
                                   else draft.world_size, draft.world_size,
                                   "agents" if backend.agent_per_rank else "hosts")
        handle = backend.open(draft, console.line, console.connected)
        handle.start_heartbeats(spec.heartbeat_timeout)
        suspension.handle = handle
        if not cluster.named:
            cluster = cluster.renamed([handle.channels[i].host for i in handle.leaders])
        outcome = probe_cluster(handle, cluster, backend, spec.hosts, versions=multi,
                                script=probed_script(spec), log_files=log_files(draft))
        _check_preflight(spec, outcome)
        plan = _plan(spec, cluster, backend, env, job_id, restart, outcome)
        if multi:
            say(f"preflight ok on {len(cluster.hosts)} host(s) in {outcome.seconds:.2f}s")
        if restart == 0:
            for line in describe(plan):
                say(line)
            say(f"job id {job_id[:12]} (dsrun stack {job_id[:12]} prints every rank's Python "
                f"stack while it runs)")
        handle.start(backend.prepare(plan))
        SIGNALS.hold()
    except Interrupted as exc:
        suspension.handle = None
        console.end_progress()
        if handle is not None:
            handle.close()
        return JobResult(interrupted=exc.signum, starting=True)
    except BaseException:
        SIGNALS.hold()
        suspension.handle = None
        console.end_progress()
        if handle is not None:
            handle.close()
        raise
    if clock.started is None:  # the first attempt's ranks start the --timeout
        clock.started = time.monotonic()
    try:
        supervisor = Supervisor(handle, handle.hosts, console.lines, plan.kill_grace,
                                _watch(spec, control, clock.started))
        result = supervisor.run()
    finally:
        suspension.handle = None
        console.end_progress()
    return replace(result, clock=socket.gethostname(), restarts=restart, launcher=backend.name)


def _check_preflight(spec: LaunchSpec, outcome: ProbeOutcome) -> None:
    failed = outcome.failed(strict=spec.preflight)
    if not failed:
        return
    width = max(len(r.host) for r in failed)
    for report in failed:
        say(report.line(width, strict=spec.preflight))
    names = ", ".join(r.host for r in failed)
    raise PreflightFailed(f"preflight failed on {names}: no rank was started"
                          f"{preflight_hint(failed, spec.preflight)}")


def preflight_hint(failed: list[HostReport], strict: bool) -> str:
    """What helps with these failures: ``dsrun doctor`` with the job's command
    line checks the same (log files and script included); --no_preflight
    only where a host failed on mismatches alone (versions, reaching the
    master), which is all it skips."""
    hints = ["`dsrun doctor` with the job's command line checks the hosts"]
    if strict and any(not r.errors for r in failed):
        hints.append("--no_preflight skips the version and reach checks")
    return f" ({'; '.join(hints)})"


def _run_attempts(spec: LaunchSpec, attempt: Callable[[int], JobResult],
                  clock: JobClock) -> int:
    for restart in range(spec.max_restarts + 1):
        result = attempt(restart)
        if result.exit_code == 0 or result.interrupted is not None \
                or result.timed_out is not None or restart == spec.max_restarts:
            break
        why_not = _no_restart(spec, result, clock)
        say(attempt_line(result, restart,
                         why_not or f"restarting ({restart + 1}/{spec.max_restarts})"))
        if why_not:
            break
    line = restarts_line(spec, result, restart)
    if line:
        say(line)
    # After Ctrl-C, ranks killed by dsrun's own stop are not a failure to report
    # (but the ranks it had to SIGKILL, or could not confirm stopped, are said:
    # their save-on-Ctrl-C was cut off, or may have been).
    if result.interrupted is None or any(not f.during_stop for f in result.failures):
        for line in report_lines(result):
            say(line)
    else:
        for line in sigkill_lines(result) + unconfirmed_lines(result):
            say(line)
    if result.interrupted is not None:
        say(stopped_line(result))
    return result.exit_code


def restarts_line(spec: LaunchSpec, result: JobResult, restart: int) -> str:
    """After restarts, what the last attempt's end means for the job: it
    succeeded after them, or failed with every restart used ("" otherwise)."""
    if not restart:
        return ""
    if result.exit_code == 0:
        return f"job succeeded after {restart} restart(s) (attempt {restart + 1})"
    if result.interrupted is None and result.timed_out is None \
            and restart == spec.max_restarts:
        return f"attempt {restart + 1} failed too: all {restart} restart(s) used " \
            f"(--max_restarts {spec.max_restarts})"
    return ""


def attempt_line(result: JobResult, restart: int, then: str) -> str:
    """One line on a failed attempt that is not the last: who failed, and
    what it reported (a dsrun error is only in its record, so this line is
    the only place the terminal shows it), then what happens next."""
    cause = result.root_cause
    if cause is None:
        return f"attempt {restart + 1} failed; {then}"
    trigger = result.trigger
    early = ""
    if trigger is not None:  # name the early exit, then show what failed after it
        early = f"rank {cause.rank} exited with status 0 early, the likely cause; then "
        cause = trigger
    who = f"on rank {cause.rank}" if cause.rank is not None else f"on host {cause.host}"
    said = cause.summary()
    return (f"attempt {restart + 1} failed ({early}{cause.cause()} {who})"
            f"{': ' + said if said else ''}; {then}")


def _no_restart(spec: LaunchSpec, result: JobResult, clock: JobClock) -> str | None:
    """Why a failed attempt is not restarted, or None to restart it."""
    if result.hurried is not None:
        return f"not restarting: stopped by {signal.Signals(result.hurried).name}"
    if not restartable(result.root_cause):
        return "not restarting: this error recurs on every attempt (the same script, " \
               "config and world size)"
    left = clock.left(spec.timeout)
    if left is not None and left <= 0:
        return f"not restarting: the job's --timeout of {spec.timeout:g}s has passed"
    return None
