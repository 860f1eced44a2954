"""Which environment variables a job's ranks get from the launcher (pure).

A local job's node agent inherits dsrun's whole environment. A remote
agent starts in the SSH login environment of its host, so dsrun forwards a
documented set of the launcher's variables, plus whatever the user adds.
Every forwarded value travels inside the agent's start payload (its stdin),
never on a command line; dry-run output and logs show only the keys.

Sources, lowest precedence first (a later source overrides an earlier one):

1. the remote host's login environment (not handled here);
2. launcher variables matching :data:`DEFAULT_PREFIXES` or
   :data:`DEFAULT_NAMES` (remote jobs only; see :func:`forward_defaults`).
   The prefixes include DeepSpeed's runner's ``EXPORT_ENVS`` (``MLFLOW``,
   ``PYTHON``, ``MV2``, ``UCX``, and its CUDA accelerator's ``NCCL``), all
   as plain prefixes as there;
3. launcher variables matching a ``--env_prefix P`` (remote jobs only);
4. env files: ``~/.deepspeed_env``, ``~/.dsrun_env``, then
   ``./.deepspeed_env``, ``./.dsrun_env`` (working directory wins over home,
   dsrun's own name over DeepSpeed's). ``DS_ENV_FILE`` in the launcher's
   environment names DeepSpeed's file instead of ``.deepspeed_env``, as in
   DeepSpeed (looked up in ``~`` and ``.``; an absolute path is one file);
   when it is set, the file must exist. DeepSpeed's files apply only to a
   job on more than one host or on a host that is not this one, as
   DeepSpeed reads them only on its multi-node path (``multi_node_exec``);
   dsrun's ``.dsrun_env`` files apply to every job;
5. ``--env KEY=VALUE`` on the command line.

dsrun's own per-rank variables (RANK, WORLD_SIZE, MASTER_ADDR, ...) are set
after all of these and cannot be overridden.

:data:`NEVER_FORWARDED` variables describe the launcher's own host or job
(``CUDA_VISIBLE_DEVICES``, a parent job's ``DSRUN_JOB_ID`` or
``DSRUN_CONFIG``: dsrun run inside a rank) and are not forwarded by a
prefix match.

A job with a host that is not this one gets the launcher's absolute
working directory first on its ranks' ``PYTHONPATH`` (the forwarded entry;
the directory alone when the launcher has none), as DeepSpeed's multi-node
runner does, so that the project's own packages import on every host; a
job on this host alone keeps the launcher's ``PYTHONPATH`` as it is, as
DeepSpeed does on one node.
``PYTHONHOME`` (the launcher's interpreter's, which remote agents start
without) is one of them. ``PATH`` is not forwarded (the launcher host's
directories need not exist elsewhere); instead remote ranks get the
launcher interpreter's directory in front of their login ``PATH``, so
``python`` and the venv's scripts resolve as they do locally.

Env file syntax: ``KEY=VALUE`` per line; blank lines and lines starting with
``#`` are ignored; ``export KEY=VALUE`` is accepted; one pair of matching
quotes around the whole value is removed; no inline comments. ``$NAME`` and
``${NAME}`` in a value are expanded by the node agent on the host the rank
runs on (:mod:`dsrun.launcher.envlayers`), as DeepSpeed's remote shell
expands its ``export KEY="VALUE"`` lines, with the job's forwarded and
``--env`` variables set before the file lines (DeepSpeed exports the
forwarded ones first, a forwarded name that a file sets again in its
first place); a value in single quotes is literal. A malformed line is an
error naming ``file:line`` and what is wrong (never the text, which may
hold a secret).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from dsrun.errors import DsrunUsageError
from dsrun.launcher.envlayers import LAUNCHER_OWNED

#: Prefixes of launcher variables forwarded to remote ranks by default.
DEFAULT_PREFIXES = ("NCCL", "CUDA_", "OMP_", "GLOO_", "TORCH_", "PYTORCH_", "DSRUN_",
                    "UCX", "MV2", "MLFLOW", "PYTHON")
#: Whole names forwarded to remote ranks by default.
DEFAULT_NAMES = ("VIRTUAL_ENV",)
#: Describe the launcher's own host or job: never forwarded by a prefix match
#: (LAUNCHER_OWNED: what a parent job's launcher set for its ranks).
NEVER_FORWARDED = LAUNCHER_OWNED | frozenset({
    "CUDA_VISIBLE_DEVICES",
    "DSRUN_FAKE_GPUS", "DSRUN_SSH_CONFIG",
    # the launcher's interpreter's (agents elsewhere start without them)
    "PYTHONHOME", "PYTHONEXECUTABLE",
    # an agent's own connect-back variables (protocol.AGENT_BOOTSTRAP_VARS)
    "DSRUN_LAUNCHER", "DSRUN_LAUNCHER_SECRET", "DSRUN_LAUNCHER_TIMEOUT", "DSRUN_PYTHONPATH_WAS",
})
#: Env file names, in the order they are read within one directory.
ENV_FILE_NAMES = (".deepspeed_env", ".dsrun_env")
#: DeepSpeed's variable naming its env file instead of ``.deepspeed_env``.
DS_ENV_FILE_VAR = "DS_ENV_FILE"

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


@dataclass(frozen=True)
class EnvEntry:
    """One variable for the ranks and where it came from (for messages)."""

    key: str
    value: str
    source: str
    #: An env-file value whose ``$NAME`` / ``${NAME}`` the agent expands.
    expand: bool = False

    def __repr__(self) -> str:  # never show the value
        return f"EnvEntry({self.key!r}, <value>, {self.source!r})"


@dataclass(frozen=True)
class JobEnv:
    """The user-level variables every rank gets, by key; values are private.

    ``files``: (key, expand) of the variables whose value comes from an env
    file, in the order their lines were read (the agent expands them in
    that order: :func:`dsrun.launcher.envlayers.expand_file_values`).
    """

    entries: tuple[EnvEntry, ...] = ()
    files: tuple[tuple[str, bool], ...] = ()

    def as_dict(self) -> dict[str, str]:
        return {e.key: e.value for e in self.entries}

    def keys(self) -> tuple[str, ...]:
        return tuple(e.key for e in self.entries)

    def expanded_keys(self) -> tuple[str, ...]:
        """Keys whose value the agent expands on its host."""
        return tuple(key for key, expand in self.files if expand)

    def passed_as_is(self) -> dict[str, str]:
        """The variables a tool (mpirun, srun) may pass to the agents as they
        are here: all but the env-file values each agent expands on its own
        host, which reach it in the start payload only (so ``$PATH`` there
        is the host's own)."""
        expanded = set(self.expanded_keys())
        return {e.key: e.value for e in self.entries if e.key not in expanded}

    def describe(self) -> list[str]:
        """``KEY=<value not shown> (source)`` lines, sorted by key."""
        return [f"{e.key}=<value not shown> ({e.source}"
                f"{'; $NAME expanded on the host' if e.expand else ''})"
                for e in sorted(self.entries, key=lambda e: e.key)]


def name_problem(key: str) -> str | None:
    """What is wrong with ``key`` as a variable name, in words that quote
    none of it (it may be a secret typed where a name belongs), or None."""
    if _NAME.match(key):
        return None
    if not key:
        return "the name is empty"
    if key[0].isdigit():
        return "the name starts with a digit"
    bad = next(c for c in key if not (c.isascii() and (c.isalnum() or c == "_")))
    if bad.isspace():
        return "a space before '='"
    if bad in ":\"'":
        return {":": "a ':' in the name (KEY: VALUE is YAML, not KEY=VALUE)",
                '"': "a quote in the name", "'": "a quote in the name"}[bad]
    return f"a {'non-ASCII' if not bad.isascii() else 'punctuation'} character in the name " \
           f"(letters, digits and '_' only)"


def check_name(key: str, where: str) -> None:
    """A usage error at ``where`` for a key that is no variable name; the
    message never quotes the key (see :func:`name_problem`)."""
    problem = name_problem(key)
    if problem:
        raise DsrunUsageError(f"{where}: invalid environment variable name: {problem} "
                              f"(not shown: the text may hold a secret)")


def check_prefix(prefix: str) -> None:
    if not prefix or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", prefix):
        raise DsrunUsageError(f"--env_prefix: invalid prefix {prefix!r} "
                              "(letters, digits and '_', not starting with a digit)")


def _unquote(value: str) -> tuple[str, bool]:
    """The value without one pair of matching quotes around it, and whether
    the agent expands it (it has a ``$``, outside single quotes)."""
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1], value[0] == '"' and "$" in value
    return value, "$" in value


def parse_env_file(text: str, path: str) -> list[EnvEntry]:
    """The ``KEY=VALUE`` entries of an env file; DsrunUsageError at file:line."""
    entries = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{number}"
        if line.startswith("export") and line[6:7] in (" ", "\t"):
            line = line[6:].lstrip()
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep:
            raise DsrunUsageError(f"{where}: expected KEY=VALUE (no '=' on this line)")
        if not key:
            raise DsrunUsageError(f"{where}: expected KEY=VALUE (no name before '=')")
        check_name(key, where)
        text, expand = _unquote(value.strip())
        entries.append(EnvEntry(key, text, where, expand))
    return entries


def _env_files(cwd: str, home: str,
               environ: Mapping[str, str] | None) -> list[tuple[str, bool]]:
    """(path, DeepSpeed's) of every env file, in precedence order."""
    ds_name = (environ or {}).get(DS_ENV_FILE_VAR) or ENV_FILE_NAMES[0]
    names = ((os.path.expanduser(ds_name), True), *((n, False) for n in ENV_FILE_NAMES[1:]))
    dirs = [home] if os.path.realpath(home) == os.path.realpath(cwd) else [home, cwd]
    files: dict[str, bool] = {}
    for path, deepspeeds in ((os.path.join(d, n), ds) for d in dirs for n, ds in names):
        # an absolute DS_ENV_FILE: read once; one naming .dsrun_env: dsrun's
        files[path] = files.get(path, True) and deepspeeds
    return list(files.items())


def env_file_paths(cwd: str, home: str, environ: Mapping[str, str] | None = None, *,
                   multi_host: bool = True) -> list[str]:
    """Env files in precedence order (later wins): home first, then cwd;
    ``DS_ENV_FILE`` in ``environ`` replaces DeepSpeed's name (see above).
    DeepSpeed's files only for a ``multi_host`` job (see above)."""
    return [path for path, deepspeeds in _env_files(cwd, home, environ)
            if multi_host or not deepspeeds]


def unapplied_env_files(cwd: str, home: str, environ: Mapping[str, str]) -> list[str]:
    """DeepSpeed's env files that exist but a job on this host alone does not
    apply (for one line in the start banner and --dry-run)."""
    return [path for path, deepspeeds in _env_files(cwd, home, environ)
            if deepspeeds and os.path.isfile(path)]


def check_ds_env_file(cwd: str, home: str, environ: Mapping[str, str]) -> None:
    """A ``DS_ENV_FILE`` that names no existing file is a usage error (a
    typo would silently leave the ranks without its variables)."""
    name = environ.get(DS_ENV_FILE_VAR)
    if not name:
        return
    candidates = dict.fromkeys(os.path.join(d, os.path.expanduser(name)) for d in (home, cwd))
    if not any(os.path.isfile(p) for p in candidates):
        raise DsrunUsageError(f"{DS_ENV_FILE_VAR}={name!r} (environment) names no file: "
                              f"looked for {', '.join(candidates)}")


def read_env_files(paths: Iterable[str]) -> list[EnvEntry]:
    """Entries of every existing file among ``paths``, in order (I/O)."""
    entries: list[EnvEntry] = []
    for path in paths:
        try:
            with open(path, encoding="utf-8-sig") as f:  # a BOM (Windows editors) is no key
                text = f.read()
        except FileNotFoundError:
            continue
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc)
            raise DsrunUsageError(f"cannot read env file {path}: {reason}") from None
        entries.extend(parse_env_file(text, path))
    return entries


def forward_defaults(environ: Mapping[str, str],
                     prefixes: Sequence[str] = DEFAULT_PREFIXES,
                     names: Sequence[str] = DEFAULT_NAMES) -> list[EnvEntry]:
    """Launcher variables forwarded by default, sorted by key."""
    return [EnvEntry(k, environ[k], "forwarded")
            for k in sorted(environ)
            if k not in NEVER_FORWARDED and (k in names or k.startswith(tuple(prefixes)))]


def forward_prefixes(environ: Mapping[str, str], prefixes: Sequence[str]) -> list[EnvEntry]:
    """Launcher variables matching a user's ``--env_prefix``, sorted by key."""
    out = []
    for key in sorted(environ):
        for prefix in prefixes:
            if key.startswith(prefix) and key not in NEVER_FORWARDED:
                out.append(EnvEntry(key, environ[key], f"--env_prefix {prefix}"))
                break
    return out


def compose(*layers: Iterable[EnvEntry]) -> JobEnv:
    """Merge layers, later layers overriding earlier ones; sorted by key."""
    merged: dict[str, EnvEntry] = {}
    for layer in layers:
        for entry in layer:
            merged[entry.key] = entry
    return JobEnv(tuple(merged[k] for k in sorted(merged)))


def cwd_pythonpath(environ: Mapping[str, str], cwd: str) -> EnvEntry:
    """The launcher's PYTHONPATH with its working directory first, as
    DeepSpeed's multi-node runner gives every rank (``cwd`` alone when the
    launcher has no PYTHONPATH; an empty one keeps its ``:``, as there)."""
    path = os.path.abspath(cwd)
    value = f"{path}:{environ['PYTHONPATH']}" if "PYTHONPATH" in environ else path
    return EnvEntry("PYTHONPATH", value, "forwarded, the working directory first")


def job_env(environ: Mapping[str, str], *, remote: bool, env_prefixes: Sequence[str] = (),
            file_entries: Sequence[EnvEntry] = (),
            cli_env: Sequence[tuple[str, str]] = (), cwd_first: str | None = None) -> JobEnv:
    """The variables for the ranks, by the precedence in the module docstring.

    ``remote=False`` (a local job, whose agent inherits everything) leaves
    out the forwarded launcher variables: they are there already.
    ``cwd_first``: the working directory to put first on the forwarded
    PYTHONPATH (a job with a host that is not this one).
    """
    for prefix in env_prefixes:
        check_prefix(prefix)
    for key, _ in cli_env:
        check_name(key, "--env")
    forwarded: list[EnvEntry] = []
    if remote:
        forwarded = forward_defaults(environ) + forward_prefixes(environ, env_prefixes)
    if cwd_first is not None:
        forwarded = [e for e in forwarded if e.key != "PYTHONPATH"]
        forwarded.append(cwd_pythonpath(environ, cwd_first))
    cli = [EnvEntry(k, v, "--env") for k, v in cli_env]
    merged = compose(forwarded, file_entries, cli)
    first = {e.key for e in forwarded}
    return JobEnv(merged.entries, file_order(merged, file_entries, first))


def file_order(env: JobEnv, file_entries: Sequence[EnvEntry],
               first: Iterable[str] = ()) -> tuple[tuple[str, bool], ...]:
    """(key, expand) of ``env``'s variables that come from ``file_entries``, in
    the order of the line that set them (a later line of a key moves it).
    Keys in ``first`` (forwarded ones) come before the others, as DeepSpeed
    exports a forwarded variable that a file sets again in the forwarded
    variable's place, before every file line."""
    last: dict[str, EnvEntry] = {}
    for entry in file_entries:
        last.pop(entry.key, None)
        last[entry.key] = entry
    winners = {e.key: e for e in env.entries}
    early = set(first)
    ordered = sorted(last.items(), key=lambda item: item[0] not in early)
    return tuple((key, entry.expand) for key, entry in ordered if winners.get(key) is entry)
