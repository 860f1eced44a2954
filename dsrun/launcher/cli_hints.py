"""What dsrun says about a command line it cannot take as it is: DeepSpeed
launcher flags it lacks (and what to use instead), launcher flags written
after the script (they go to the script), options before a command's name
(the line reordered), and the usage hint after click's own message.

Pure text over click's objects: the commands are passed in, so this module
does not import :mod:`dsrun.launcher.cli`.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable, Sequence

import click

HELP_OPTIONS = ["-h", "--help"]


def option_names(command: click.Command) -> set[str]:
    """Every spelling of ``command``'s own options (a group's, not its
    subcommands'), help included."""
    names = set(HELP_OPTIONS)
    for param in command.params:
        if isinstance(param, click.Option):
            names.update(param.opts)
            names.update(param.secondary_opts)
    return names


def leading_options(run: click.Command, args: Sequence[str]
                    ) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """The ``run`` options before the first word that is not one, each as
    (its name, its words), and the words from that first word on. A short
    cluster (``-mH PATH``) counts as each of its options."""
    found: list[tuple[str, list[str]]] = []
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] != "--":
        word = args[i]
        if word.startswith("--"):
            name = word.split("=", 1)[0]
            parts = [(name, word)]
            wants = _takes_value(_long_options(run).get(name)) and "=" not in word
        else:
            parts, wants = _short_cluster(run, word)
        value = list(args[i + 1:i + 2]) if wants else []
        found.extend((name, [text, *value] if n == len(parts) - 1 else [text])
                     for n, (name, text) in enumerate(parts))
        i += 1 + len(value)
    return found, list(args[i:])


def _takes_value(option: click.Option | None) -> bool:
    """``option`` is known and reads a value (no flag, no counter)."""
    return option is not None and not (option.is_flag or option.count)


def _short_cluster(command: click.Command, word: str) -> tuple[list[tuple[str, str]], bool]:
    """The short options of ``word`` (``-mH``, ``-HPATH``), read as click
    does: letters are options until one takes a value, which is the rest of
    the word or, when nothing is left, the next word. Each as (its name, its
    own word: ``-m``, ``-HPATH``), and whether the last takes the next word.
    An unknown letter ends the cluster (click reports it)."""
    parts: list[tuple[str, str]] = []
    for pos in range(1, len(word)):
        name = "-" + word[pos]
        option = _short_option(command, name)
        if option is None or _takes_value(option):
            parts.append((name, "-" + word[pos:]))
            return parts, option is not None and pos == len(word) - 1
        parts.append((name, name))
    return parts, False


def _long_options(command: click.Command) -> dict[str, click.Option | None]:
    """Every long spelling of ``command``'s options, in declaration order
    (None: the help option, which click adds outside ``params``)."""
    names: dict[str, click.Option | None] = {}
    for param in command.params:
        if isinstance(param, click.Option):
            for opt in (*param.opts, *param.secondary_opts):
                if opt.startswith("--"):
                    names[opt] = param
    for opt in HELP_OPTIONS:
        if opt.startswith("--"):
            names.setdefault(opt, None)
    return names


#: What scripts are given, never a launcher option: left for click to
#: report (``message`` says what it is), never read as a prefix of
#: ``--local_rank_arg`` (``--local_rank=0`` out of torch.distributed.launch
#: habit would be "--local_rank_arg does not take a value").
SCRIPT_FLAGS = ("--local_rank", "--local-rank")


def _full_name(name: str, names: dict[str, click.Option | None],
               ctx: click.Context | None) -> str:
    """``name``, or the long option it is a unique prefix of (as argparse's
    allow_abbrev); several options: a usage error listing every match.

    Prefixes resolve among dsrun's options, but one that is also a prefix
    of a DeepSpeed flag dsrun lacks (``--max``: ``--max_restarts``, and
    DeepSpeed's ``--max_elastic_nodes``) is ambiguous too: a DeepSpeed
    command line must not silently become another dsrun option. A prefix
    of only such flags is left for click, and ``message`` gives the flag's
    advice."""
    if name in names or len(name) < 3 or name in SCRIPT_FLAGS:
        return name
    matches = [opt for opt in names if opt.startswith(name)]
    options = {id(names[opt]) for opt in matches}
    deepspeed = [f for f in DEEPSPEED_ONLY_FLAGS if f.startswith(name)] if matches else []
    if len(options) > 1 or deepspeed:  # two spellings of one option are not ambiguous
        also = f", or DeepSpeed's {', '.join(deepspeed)}, which dsrun does not take " \
               f"(write the option out)" if deepspeed else ""
        raise click.UsageError(f"ambiguous option: {name} could match "
                               f"{', '.join(matches)}{also}", ctx)
    return matches[0] if matches else name


def expand_abbreviations(command: click.Command, args: Sequence[str],
                         ctx: click.Context | None = None) -> list[str]:
    """``args`` with each abbreviated long option of ``command`` (a unique
    prefix, ``--num_gpu 2``, ``--master_p=99``) written out, as DeepSpeed's
    argparse parser accepts them. Only the options before the first word
    that is not one (SCRIPT) or ``--`` are read: the script's own arguments
    are never touched. A prefix of no option is left for click to report."""
    names = _long_options(command)
    out: list[str] = []
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] not in ("-", "--"):
        word = args[i]
        if word.startswith("--"):
            name, eq, value = word.partition("=")
            name = _full_name(name, names, ctx)
            word, option, attached = name + eq + value, names.get(name), bool(eq)
        else:  # short options: -H PATH, -HPATH, -m, -mH PATH
            option, attached = None, False
            if _short_cluster(command, word)[1]:
                option = _short_option(command, "-" + word[-1])
        out.append(word)
        i += 1
        if _takes_value(option) and not attached and i < len(args):
            out.append(args[i])  # its value, whatever it looks like
            i += 1
    return out + list(args[i:])


def _short_option(command: click.Command, opt: str) -> click.Option | None:
    """The option of ``command`` spelt ``opt`` (``-H``), or None."""
    for param in command.params:
        if isinstance(param, click.Option) and opt in param.opts:
            return param
    return None


def command_first(run: click.Command, load: Callable[[str], click.Command],
                  args: Sequence[str], command: str) -> str:
    """The message for CommandNotFirst, with the command line reordered:
    the options the command takes move after its name; the others are
    left out, and named. Abbreviations are written out first (click read
    ``--num_gpu 2`` as ``--num_gpus 2``)."""
    try:
        args = expand_abbreviations(run, args)
    except click.UsageError:  # an ambiguous prefix: the words as given
        pass
    options, rest = leading_options(run, args)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    if rest[:1] == [command]:
        rest = rest[1:]
    try:
        accepted = option_names(load(command))
    except Exception:  # noqa: BLE001 - a hint must not fail: keep every option
        accepted = {name for name, _ in options}
    kept = [word for name, words in options if name in accepted for word in words]
    dropped = list(dict.fromkeys(name for name, _ in options if name not in accepted))
    fixed = shlex.join(["dsrun", command, *kept, *rest])
    if not dropped:
        return (f"{command!r} is a dsrun command, and commands come first: `{fixed}` "
                f"(`dsrun {command} -h` lists the options it takes)")
    which = ", ".join(dropped)
    return (f"{command!r} is a dsrun command, and commands come first: `{fixed}` "
            f"(left out: {which}, which `dsrun {command}` does not take; "
            f"`dsrun {command} -h` lists the options it takes)")


#: Options (by parameter name) warned about when they follow the script: those
#: only a launcher has. Flags that scripts commonly take themselves (--config,
#: --timeout, --log_dir, --env, --dry-run, --cpu, --dist_backend,
#: --master_addr/--master_port, --include/--exclude, -m) pass without a word.
WARN_AFTER_SCRIPT = frozenset({
    "hostfile", "num_nodes", "num_gpus", "launcher", "launcher_args", "slurm_args",
    "ssh_port", "ssh_user", "ssh_key", "ssh_config", "ssh_insecure", "ssh_timeout",
    "no_python", "bind_cores_to_rank", "bind_core_list", "no_preflight", "env_prefixes",
    "kill_grace", "heartbeat_timeout", "max_restarts", "local_rank_arg", "no_local_rank",
})


def _dsrun_flag_names(run: click.Command) -> set[str]:
    names = set()
    for param in run.params:
        if isinstance(param, click.Option) and param.name in WARN_AFTER_SCRIPT:
            names.update(o for o in param.opts if o.startswith("--"))
    return names


def warn_flags_after_script(run: click.Command, script_args: Sequence[str]) -> list[str]:
    """Warn (once per flag) about launcher-only dsrun flags that will go to
    the script (see :data:`WARN_AFTER_SCRIPT`)."""
    known = _dsrun_flag_names(run)
    seen = []
    for arg in script_args:
        name = arg.split("=", 1)[0]
        if name in known and name not in seen:
            seen.append(name)
            click.echo(f"dsrun: warning: {name} comes after the script, so it is passed to "
                       f"the script, not to dsrun; put dsrun options before the script",
                       err=True)
    return seen


_OWN_LINES = ("its own lines (a few at start, warnings, errors, the failure report) are the "
              "stderr lines starting with 'dsrun:'")
_NO_QUIET = f"dsrun has no quiet mode: {_OWN_LINES}"

#: DeepSpeed launcher flags dsrun does not take, and what to do instead
#: (every flag of DeepSpeed 0.19.8's runner.py that dsrun lacks, and a few of
#: older versions).
DEEPSPEED_ONLY_FLAGS = {
    "--enable_each_rank_log": "DeepSpeed's --enable_each_rank_log DIR is dsrun's --log_dir DIR "
                              "(one rank_N.log per rank)",
    "--force_multi": "Not needed: dsrun launches over SSH whenever the hosts it selects are "
                     "not just this one (--launcher ssh asks for it); DeepSpeed's env files "
                     "(~/.deepspeed_env) apply to such jobs, ./.dsrun_env to every job",
    "--save_pid": "Not needed: dsrun prints the job id at start, and 'dsrun stack JOB' "
                  "reaches a running job",
    "--no_ssh_check": "Not needed: dsrun checks every host before starting; --no_preflight "
                      "skips that",
    "--autotuning": "Not implemented (DeepSpeed's autotuner)",
    "--elastic_training": "Not implemented: --max_restarts N restarts the job after a failure",
    "--min_elastic_nodes": "Not implemented: --max_restarts N restarts the job after a failure",
    "--max_elastic_nodes": "Not implemented: --max_restarts N restarts the job after a failure",
    "--node_rank": "dsrun starts every host of the job itself from one launcher (over SSH, "
                   "or with --launcher openmpi/slurm), so no host is started by hand with its "
                   "node rank; --include HOST runs on one host of the hostfile",
    "--no_ssh": "dsrun starts every host of the job itself from one launcher, with SSH "
                "(paramiko: no ssh or pdsh binary needed) or --launcher openmpi/slurm; there "
                "is no per-host manual mode: run dsrun once, on one host",
    "--venv_script": "Not needed: remote ranks run the launcher's Python interpreter, and its "
                     "directory comes first on their PATH; set variables with --env or in "
                     "./.dsrun_env",
    "--log_level": f"dsrun has no log levels: {_OWN_LINES}",
    "--quiet": _NO_QUIET,
    "-q": _NO_QUIET,
    "--comment": "Pass Slurm options with --slurm_args",
    "--account": "Pass Slurm options with --slurm_args",
}


_EVERY_RANKS_OUTPUT = ("dsrun always shows every rank's stdout and stderr, each line prefixed "
                      "[host:rank]; --log_dir DIR also writes each rank's output to "
                      "DIR/rank_N.log")
_SHUTDOWN = ("dsrun's --kill_grace S (default 30, as torchrun's) is the seconds the ranks get "
             "between the stop's SIGTERM (SIGINT for a Ctrl-C) and SIGKILL; --timeout S "
             "would end the whole job after S seconds")
_SIGNALS_TO_HANDLE = ("dsrun always passes SIGINT, SIGTERM and SIGHUP on to the ranks as a "
                      "stop (SIGTERM, or SIGINT for a Ctrl-C; --kill_grace S before SIGKILL), "
                      "and SIGUSR1 and SIGUSR2 to the ranks' process groups without stopping "
                      "the job")
#: torchrun's flags with another answer in dsrun (its output flags: dsrun
#: has one way to keep each rank's output).
TORCHRUN_FLAGS = {
    "--tee": _EVERY_RANKS_OUTPUT,
    "--redirects": _EVERY_RANKS_OUTPUT,
    "--local-ranks-filter": _EVERY_RANKS_OUTPUT,
    "--local_ranks_filter": _EVERY_RANKS_OUTPUT,
    "--shutdown_timeout": _SHUTDOWN,
    "--shutdown-timeout": _SHUTDOWN,
    "--signals_to_handle": _SIGNALS_TO_HANDLE,
    "--signals-to-handle": _SIGNALS_TO_HANDLE,
}


def usage_hint(exc: click.ClickException, name: str | None) -> str:
    if not isinstance(exc, click.UsageError):
        return ""
    path = exc.ctx.command_path if exc.ctx is not None else "dsrun"
    hint = f" (see {path} --help)"
    if name is not None and os.path.exists(name):
        hint += (f"; '{name}' here is a file, but '{name}' is a dsrun command: run the "
                 f"file as 'dsrun ./{name}' or 'dsrun run {name}'")
    return hint


def message(exc: click.ClickException) -> str:
    """click's message, or for a DeepSpeed launcher flag (or a flag of the
    script's, :data:`SCRIPT_FLAGS`) what to do instead."""
    if isinstance(exc, click.NoSuchOption):
        name = exc.option_name
        if name in SCRIPT_FLAGS:
            return (f"No such option '{name}': {name} is what DeepSpeed's launcher (and "
                    f"torch.distributed.launch) gives each rank's script, not a launcher "
                    f"option: dsrun fills it in itself for a script whose argparse parser "
                    f"declares it (--local_rank_arg: for any script; --no_local_rank: never)")
        if name in TORCHRUN_FLAGS:
            return f"No such option '{name}' (a torchrun flag). {TORCHRUN_FLAGS[name]}."
        # DeepSpeed takes unique prefixes of its flags (argparse): so do the hints
        flags = [name] if name in DEEPSPEED_ONLY_FLAGS else \
            [f for f in DEEPSPEED_ONLY_FLAGS if name.startswith("--") and f.startswith(name)]
        if len(flags) == 1:
            flag = flags[0]
            shown = "" if flag == name else f" = {flag}"
            return (f"No such option '{name}' (a DeepSpeed launcher flag{shown}). "
                    f"{DEEPSPEED_ONLY_FLAGS[flag]}.")
    return exc.format_message()
