"""The ``dsrun`` command line: parse -> spec -> plan -> launch -> exit code.

``dsrun [OPTIONS] SCRIPT [SCRIPT_ARGS...]`` runs a job; ``dsrun run ...``
is the same command spelled out. The other subcommands (``hosts``,
``doctor``, ``stack``, ...) are listed in :data:`SUBCOMMANDS` and loaded
only when named; ``dsrun --help`` lists them all in its Commands section.
Rule: a subcommand name as SCRIPT, with no file of that name in the working
directory, is taken for a command given after options (an error saying
commands come first); a subcommand name as the first word always wins over
a file of that name. A script named like a command runs as ``dsrun ./hosts``
or ``dsrun run hosts``; after ``-m``/``--no_python``, or after an explicit
``run``, SCRIPT is always the program (a module, a program on PATH).
Everything after SCRIPT goes to the script untouched. Every user error ends
as one ``dsrun: error: ...`` line and exit status 2, before anything is
started.
"""

from __future__ import annotations

import signal
import sys


def _interrupted_while_starting(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # quiet: no traceback of half-done imports


# Ctrl-C while this module's imports run (most of dsrun's start-up time) ends
# dsrun quietly with 130, as later; restored at the end of this module.
_PREVIOUS_SIGINT = None
if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not ignored (nohup, &)
    try:
        _PREVIOUS_SIGINT = signal.signal(signal.SIGINT, _interrupted_while_starting)
    except ValueError:  # imported outside the main thread
        pass

import importlib  # noqa: E402
import os  # noqa: E402
from collections.abc import Sequence  # noqa: E402

import click  # noqa: E402

from dsrun import DSRUN_VERSION  # noqa: E402
from dsrun.errors import DsrunError, DsrunUsageError  # noqa: E402
from dsrun.launcher import cli_hints, launch  # noqa: E402
from dsrun.launcher.cli_specs import (  # noqa: E402
    host_options,
    hosts_spec_from_params,
    spec_from_params,
)
from dsrun.launcher.console import OutputFailed  # noqa: E402
from dsrun.launcher.spec import DEFAULT_HEARTBEAT_TIMEOUT, DIST_BACKENDS, LaunchSpec  # noqa: E402

HELP_OPTIONS = cli_hints.HELP_OPTIONS
CONTEXT = {"allow_interspersed_args": False, "help_option_names": HELP_OPTIONS}

#: Subcommands: name -> "module:attribute" of its click command, imported only
#: when the subcommand is named (or listed by ``dsrun --help``). A subcommand
#: name always wins over a file of that name in the working directory.
SUBCOMMANDS: dict[str, str] = {
    "run": "dsrun.launcher.cli:run_command",
    "hosts": "dsrun.launcher.hosts_cli:hosts",
    "doctor": "dsrun.launcher.cli:doctor_command",
    "stack": "dsrun.launcher.cli:stack_command",
    "checkpoint": "dsrun.launcher.checkpoint_cli:checkpoint",
    "plot": "dsrun.launcher.plot_cli:plot",
}


def load_command(name: str) -> click.Command:
    """The click command of subcommand ``name`` (import errors propagate)."""
    module, attr = SUBCOMMANDS[name].split(":")
    command = getattr(importlib.import_module(module), attr)
    if not isinstance(command, click.Command):
        raise TypeError(f"{SUBCOMMANDS[name]} is not a click command")
    return command


def _command_rows() -> list[tuple[str, str]]:
    """(name, one-line help) of every subcommand, for ``dsrun --help``."""
    rows = []
    for name in SUBCOMMANDS:
        try:
            text = load_command(name).get_short_help_str(limit=70)
        except Exception as exc:  # noqa: BLE001 - help must still print
            text = f"(cannot be loaded: {type(exc).__name__}: {exc})"
        rows.append((name, text))
    return rows


class AbbrevCommand(click.Command):
    """A command that takes unique prefixes of its long options before its
    first argument (``--num_gpu 2``), as DeepSpeed's argparse launcher does."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, cli_hints.expand_abbreviations(self, args, ctx))


class RunCommand(AbbrevCommand):
    """``dsrun [OPTIONS] SCRIPT``: its help ends with the subcommands."""

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with formatter.section("Commands"):
            formatter.write_dl(_command_rows())
        formatter.write_paragraph()
        formatter.write_text(
            "dsrun COMMAND --help (or -h) shows a command's options. A command name wins "
            "over a file of that name here: run a script named like a command as "
            "'dsrun ./hosts' or 'dsrun run hosts' (a module: 'dsrun -m hosts').")


def _env_pair(ctx: click.Context, param: click.Parameter, values: Sequence[str]):
    pairs = []
    for value in values:
        key, sep, val = value.partition("=")
        if not sep or not key:
            # Not the value itself: it may be a secret typed without its name.
            problem = "no '=' in it" if not sep else "no name before '='"
            raise click.BadParameter(f"expected KEY=VALUE ({problem})")
        pairs.append((key, val))
    return tuple(pairs)


@click.command("run", cls=RunCommand, context_settings=CONTEXT)
@click.version_option(DSRUN_VERSION, "--version", prog_name="dsrun",
                      message="%(prog)s %(version)s")
@host_options
@click.option("-m", "--module", "module", is_flag=True,
              help="Run SCRIPT as a module, like python -m.")
@click.option("--no_python", "--no-python", "no_python", is_flag=True,
              help="Run SCRIPT as an executable, without python and without the "
                   "injected runtime.")
@click.option("--log_dir", "--log-dir", "log_dir", default=None, type=click.Path(),
              help="Also write each rank's output to LOG_DIR/rank_N.log.")
@click.option("--dry-run", "--dry_run", "dry_run", is_flag=True,
              help="Print the rank map and each rank's command and environment, "
                   "then exit without starting anything.")
@click.option("--max_restarts", "--max-restarts", "max_restarts", type=int, default=0,
              show_default=True, help="Restart the whole job up to N times after a failure.")
@click.option("--kill_grace", "--kill-grace", "kill_grace", type=float, default=30.0,
              show_default=True, help="Seconds between SIGTERM (or SIGINT) and SIGKILL "
              "when stopping ranks (torchrun's --shutdown_timeout); after a rank's "
              "failure, at most 5.")
@click.option("--config", "config", default=None,
              type=click.Path(exists=True, dir_okay=False),
              help="A DeepSpeed-style JSON config handed to every rank (DSRUN_CONFIG); "
                   "dsrun.initialize() uses it when the script passes none.")
@click.option("--local_rank_arg", "local_rank_arg", flag_value="--local_rank", default=None,
              help="Also append --local_rank=N to each rank's arguments, as DeepSpeed's "
                   "launcher does (environment variables are always set).")
@click.option("--local-rank-arg", "local_rank_arg", flag_value="--local-rank",
              help="The same with torch.distributed.launch's spelling: --local-rank=N.")
@click.option("--no_local_rank", "--no-local-rank", "no_local_rank", is_flag=True,
              help="Never fill in --local_rank (DeepSpeed's flag). By default a script whose "
                   "argparse parser declares --local_rank/--local-rank gets it filled in with "
                   "the rank's local rank when its command line does not give it.")
@click.option("--timeout", "timeout", type=float, default=None, metavar="S",
              help="End the job after S seconds: exit 124, and the report names the ranks "
                   "still running, with their Python stacks.")
@click.option("--heartbeat_timeout", "--heartbeat-timeout", "heartbeat_timeout", type=float,
              default=DEFAULT_HEARTBEAT_TIMEOUT, show_default=True, metavar="S",
              help="A host silent for S seconds is lost: the job stops on every other host "
                   "and the report names it; an agent that hears nothing from dsrun for S "
                   "seconds stops its ranks. 0: off.")
@click.option("--bind_cores_to_rank", "--bind-cores-to-rank", "bind_cores_to_rank",
              is_flag=True,
              help="Bind each rank to an equal, disjoint share of its host's CPUs (in "
                   "local-rank order) and set its OMP_NUM_THREADS to the share's size.")
@click.option("--bind_core_list", "--bind-core-list", "bind_core_list", default=None,
              metavar="LIST",
              help="Share out only these CPUs, e.g. 0-7,16-23 (implies --bind_cores_to_rank).")
@click.option("--dist_backend", "--dist-backend", "dist_backend", default=None,
              type=click.Choice(DIST_BACKENDS),
              help="torch.distributed backend for the injected runtime "
                   "(default: nccl on GPU ranks, gloo on CPU ranks; 'none' skips it; "
                   "'mpi' only with --launcher openmpi or slurm and a torch built "
                   "with MPI).")
@click.option("--env", "env", multiple=True, callback=_env_pair, metavar="KEY=VALUE",
              help="Set an environment variable for every rank (repeatable). The value "
                   "travels to the hosts on the agents' stdin, never on a command line "
                   "(but it is on dsrun's own: put secrets in ./.dsrun_env or ~/.dsrun_env).")
@click.option("--env_prefix", "--env-prefix", "env_prefixes", multiple=True, metavar="PREFIX",
              help="Also forward the launcher's variables starting with PREFIX to remote "
                   "ranks (repeatable; NCCL, CUDA_, OMP_, GLOO_, TORCH_, PYTORCH_, DSRUN_, "
                   "UCX, MV2, MLFLOW, PYTHON (not PYTHONHOME), VIRTUAL_ENV are forwarded by "
                   "default).")
@click.option("--no_preflight", "--no-preflight", "no_preflight", is_flag=True,
              help="Start a multi-host job even if versions differ between hosts or the "
                   "master port is not reachable from some host.")
@click.argument("script")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
def run_command(**params: object) -> int:
    """Launch SCRIPT on every selected rank."""
    script = str(params["script"])
    if script in SUBCOMMANDS and not os.path.exists(script) and not params["module"] \
            and not params["no_python"] and click.get_current_context().obj is not EXPLICIT_RUN:
        raise CommandNotFirst(script)
    warn_flags_after_script(params["script_args"])  # type: ignore[arg-type]
    try:
        return launch.run(spec_from_params(params))
    except BrokenPipeError:
        # `dsrun ... | head`: the job has been stopped on the way out (the
        # supervisor's finally); exit as a command killed by SIGPIPE would,
        # without a word and without a second error when Python flushes.
        _discard_output()
        return 128 + signal.SIGPIPE
    except OutputFailed as exc:
        # Not a closed pipe (a full disk, a file size limit): the job was
        # stopped, and a quiet 141 would send the user looking for a pipe.
        _say_and_discard_output(f"dsrun: error: {exc.line()}\n")
        return 1


#: ``ctx.obj`` of ``dsrun run ...`` spelled out: its SCRIPT is never a command name.
EXPLICIT_RUN = "explicit run"


class CommandNotFirst(DsrunUsageError):
    """An option came before a command's name (`dsrun --ssh_config X doctor`),
    so the name was taken as the script of a run."""

    def __init__(self, command: str) -> None:
        super().__init__(f"{command!r} is a dsrun command, and commands come first")
        self.command = command


def _say_and_discard_output(line: str) -> None:
    """One line on stderr if it can still be written, then no more output
    (what the failed stream still buffers would fail again at exit)."""
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    try:
        os.write(sys.stderr.fileno(), line.encode("utf-8", "replace"))
    except (OSError, ValueError, AttributeError):
        pass
    _discard_output()


def _discard_output() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError, AttributeError):
            pass
    os.close(devnull)


def _doctor(**params: object) -> int:
    """Check every selected host before a launch: one line per host.

    Checks SSH reachability, the Python interpreter, dsrun and torch versions
    (equal to this host's), the working directory, devices >= slots, that
    the master port is free and that every host reaches it. Takes the job's
    own command line (dsrun doctor [OPTIONS] [SCRIPT [ARGS...]]): with
    SCRIPT, it must be present here and on every host; options that do not
    choose the hosts are accepted and not used.
    """
    from dsrun.launcher import doctor

    if params["script"] is None:
        return doctor.run_doctor(hosts_spec_from_params(params), launch.working_directory())
    spec = spec_from_params(params)
    return doctor.run_doctor(spec.hosts, launch.working_directory(), job=spec)


#: ``dsrun doctor``: the run command's options (not --version), SCRIPT optional.
doctor_command = AbbrevCommand(
    "doctor", context_settings=CONTEXT, callback=_doctor, help=_doctor.__doc__,
    params=[*(p for p in run_command.params if p.name not in ("version", "script",
                                                               "script_args")),
            click.Argument(["script"], required=False),
            click.Argument(["script_args"], nargs=-1, type=click.UNPROCESSED)])


@click.command("stack", context_settings={"help_option_names": HELP_OPTIONS})
@click.argument("job", required=False)
def stack_command(job: str | None) -> int:
    """Print the current Python stack of every rank of a running job.

    Every rank on every host, as [host:rank] lines. JOB is the job's id (or
    its first characters); with one job of yours running on this host it
    is not needed, with several dsrun lists them.
    """
    from dsrun.launcher import console, control

    chosen = control.choose_job(control.running_jobs(), job)
    out = console.checked_writes(click.echo, console.OUT)
    err = console.checked_writes(lambda line: click.echo(line, err=True), console.ERR)
    try:
        received, complete = control.stream_stacks(chosen["socket"], out, note=err)
    except BrokenPipeError:  # `dsrun stack | head`: quietly, as `dsrun run` does
        _discard_output()
        return 128 + signal.SIGPIPE
    except OutputFailed as exc:
        # Our own output failed (a full disk), not the job (left running):
        # said apart from the socket's errors below, which are the job's.
        _say_and_discard_output(f"dsrun: error: {exc}\n")
        return 1
    except OSError as exc:
        raise DsrunError(f"job {chosen['job_id'][:12]}: {exc.strerror or exc}") from None
    return 0 if received and complete else 1


def parse_spec(argv: Sequence[str]) -> LaunchSpec:
    """Parse ``dsrun run`` arguments into a LaunchSpec without running anything."""
    ctx = run_command.make_context("dsrun", list(argv))
    return spec_from_params(ctx.params)


def warn_flags_after_script(script_args: Sequence[str]) -> list[str]:
    """Warn about launcher-only flags that follow the script (cli_hints)."""
    return cli_hints.warn_flags_after_script(run_command, script_args)


def _dispatch(args: list[str]) -> tuple[click.Command, list[str]]:
    """The command ``args`` name and its arguments: a subcommand when the
    first word is one (even if a file of that name exists), else ``run``."""
    if args and args[0] in SUBCOMMANDS:
        return load_command(args[0]), args[1:]
    return run_command, args


#: click >= 8.2 raises this for a group named without a subcommand.
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())


def main(argv: Sequence[str] | None = None) -> int:
    for name in ("stdout", "stderr"):  # started with it closed (`>&-`): output is dropped
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w"))  # noqa: SIM115 - for the process's life
    from dsrun.launcher.jobsignals import PROGRAM

    # The dsrun program exits once the job is over: its signal handling
    # after a job stopped by a signal is the program's (jobsignals.py).
    was, PROGRAM.entry = PROGRAM.entry, True
    try:
        return _main(argv)
    except KeyboardInterrupt:  # before a command took over the signals
        return 128 + signal.SIGINT
    finally:
        PROGRAM.entry = was


def _main(argv: Sequence[str] | None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        command, rest = _dispatch(args)
    except ImportError as exc:  # a broken install: say so, never "no such script"
        click.echo(f"dsrun: error: the '{args[0]}' command cannot be loaded: "
                   f"{type(exc).__name__}: {exc}", err=True)
        return 1
    subcommand = args[0] if command is not run_command or args[:1] == ["run"] else None
    try:
        prog = "dsrun" if command is run_command else f"dsrun {args[0]}"
        obj = EXPLICIT_RUN if subcommand == "run" else None
        result = command.main(rest, prog_name=prog, standalone_mode=False, obj=obj)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.exceptions.Abort:
        return 128 + signal.SIGINT
    except _NO_ARGS_IS_HELP as exc:  # `dsrun hosts`: its help, not an error
        click.echo(exc.ctx.get_help() if exc.ctx is not None else exc.format_message())
        return 0
    except click.ClickException as exc:
        hint = cli_hints.usage_hint(exc, subcommand)
        click.echo(f"dsrun: error: {cli_hints.message(exc)}{hint}", err=True)
        return exc.exit_code
    except CommandNotFirst as exc:
        fixed = cli_hints.command_first(run_command, load_command, args, exc.command)
        click.echo(f"dsrun: error: {fixed}", err=True)
        return exc.exit_code
    except DsrunError as exc:
        click.echo(f"dsrun: error: {exc}", err=True)
        return exc.exit_code
    return result if isinstance(result, int) else 0


if _PREVIOUS_SIGINT is not None:  # the imports are done: Ctrl-C as before
    signal.signal(signal.SIGINT, _PREVIOUS_SIGINT)

if __name__ == "__main__":
    sys.exit(main())
