"""``dsrun hosts``: list, validate, format and edit a hostfile from the shell.

The hostfile is the one named with ``-H/--hostfile`` (on the group, as in
``dsrun hosts -H F list``, or on any subcommand, as in ``dsrun hosts list
-H F``), else ``./hostfile``, else the job hostfile
(:data:`hostfile.DEFAULT_JOB_HOSTFILE`); ``add`` creates ``./hostfile`` when
there is none, and says so (jobs started in that directory then use it).
Edits go through the pure text functions of :mod:`dsrun.launcher.hostfile`,
so the user's comments, blank lines and order survive, and an edit that
would make the file invalid is refused (exit 2) before anything is
written. Files are replaced atomically (temporary file in the same
directory, then ``os.replace``) keeping their mode, and every edit (read,
change, replace) holds the hostfile's edit lock (:func:`edit_lock`), so
concurrent edits of one hostfile (nodes adding themselves at boot) all
land, one after the other. ``validate`` exits 1
when the file has problems; every other error is printed as ``dsrun:
error: <message>`` with the error's exit code.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import fcntl
import functools
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NoReturn, TypeVar

import click

from dsrun.atomicfile import AtomicFile
from dsrun.errors import DsrunError, DsrunUsageError, HostfileError
from dsrun.launcher import hostfile as hf

F = TypeVar("F", bound=Callable[..., object])


# --------------------------------------------------------------------------
# helpers (error reporting, paths, atomic write, rendering)


def exit_with_error(error: DsrunError) -> NoReturn:
    """Print ``dsrun: error: <message>`` on stderr and exit with its code."""
    click.echo(f"dsrun: error: {error}", err=True)
    raise click.exceptions.Exit(error.exit_code)


def reports_errors(func: F) -> F:
    """Decorate a click callback so that DsrunErrors become clean exits."""

    @functools.wraps(func)
    def wrapper(*args: object, **kwargs: object) -> object:
        try:
            return func(*args, **kwargs)
        except DsrunError as error:
            exit_with_error(error)

    return wrapper  # type: ignore[return-value]


@dataclass(frozen=True)
class _HostsOptions:
    """Options of the ``hosts`` group, found by subcommands via the context."""

    hostfile: str | None


def _explicit_path(ctx: click.Context) -> str | None:
    """-H of the subcommand, else of the group; both given must agree."""
    group = ctx.find_object(_HostsOptions)
    outer = group.hostfile if group is not None else None
    inner = ctx.params.get("hostfile")
    if inner is not None and outer is not None and inner != outer:
        raise DsrunUsageError(f"-H/--hostfile given twice with different paths: {outer!r} "
                              f"(before the subcommand) and {inner!r} (after it)")
    path = inner if inner is not None else outer
    if path is not None and not path:
        raise DsrunUsageError("-H/--hostfile: the path is empty")
    return path


def _hostfile_path(ctx: click.Context, create: bool = False, writes: bool = True) -> str:
    """The hostfile a command works on (see the module docstring); never a
    device, and never a pipe for a command that ``writes`` it
    (:func:`_refuse_special`)."""
    explicit = _explicit_path(ctx)
    if explicit is not None and hf.is_no_hostfile(explicit):
        raise DsrunUsageError(f"-H {explicit} means no hostfile (a job then runs on this "
                              f"host only): there is nothing to list or edit; name a hostfile")
    if explicit is not None:
        return _refuse_special(explicit, writes)
    found = hf.default_hostfile_path(os.curdir)
    if found is not None:
        return _refuse_special(found, writes)
    if create:
        return os.path.join(os.curdir, hf.LOCAL_HOSTFILE)
    raise DsrunUsageError(
        f"no hostfile found: name one with -H/--hostfile, or create ./{hf.LOCAL_HOSTFILE} "
        f"(neither it nor {hf.DEFAULT_JOB_HOSTFILE} exists)"
    )


def _refuse_special(path: str, writes: bool = True) -> str:
    """``path``, unless it is a device (through symlinks), or a pipe when the
    command ``writes``: the atomic replace of an edit or ``fmt`` would put a
    regular file in its place. A command that only reads takes a pipe, as a
    job does (``-H <(cmd)``). A directory or a missing file is left to the
    read, which names it."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return path
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode) or (stat.S_ISFIFO(mode) and not writes):
        return path
    kind = "a pipe" if stat.S_ISFIFO(mode) else "a device"
    raise HostfileError(f"hostfile {path!r} is not a regular file ({kind}); refusing to "
                        f"{'edit' if writes else 'read'} it")


def write_text_atomic(path: str, text: str) -> None:
    """Replace the file at ``path`` (through symlinks) with ``text``
    atomically (:class:`dsrun.atomicfile.AtomicFile`). What was written is
    read back and parsed by the parser a job uses (:func:`hf.parse_hostfile`)
    before it replaces the file: a result a launch would refuse is never
    put in place (HostfileError; the old file is left as it was)."""
    try:
        out = AtomicFile(path)
    except OSError as exc:
        raise HostfileError(f"cannot write hostfile {path!r}: {exc.strerror or exc}") from None
    try:
        out.file.write(text.encode("utf-8"))
        out.file.flush()
        _check_written(out.tmp, path)
        out.finish()
    except BaseException as exc:
        out.abort()  # only the temporary file
        if isinstance(exc, OSError):
            raise HostfileError(
                f"cannot write hostfile {path!r}: {exc.strerror or exc}") from None
        raise


def _check_written(tmp: str, path: str) -> None:
    """Parse the temporary file ``tmp`` (to become ``path``) as a job
    would read ``path``; HostfileError naming both when it does not parse."""
    try:
        hf.parse_hostfile(hf.read_hostfile_text(tmp), path)
    except HostfileError as exc:
        old = "left unchanged" if os.path.lexists(path) else "not created"
        raise HostfileError(f"refusing to write hostfile {path!r}: the edited text, read "
                            f"back, would not parse as a hostfile (a bug in the edit; "
                            f"{path!r} is {old}):\n{exc}") from None


def _lock_file(path: str) -> str:
    """The edit lock of hostfile ``path``: ``.NAME.lock`` next to the file
    it names (through symlinks), so every path to one hostfile shares it."""
    directory, name = os.path.split(os.path.realpath(path))
    return os.path.join(directory, f".{name}.lock")


def _open_lock(path: str, lock: str) -> int | None:
    """The lock file's descriptor; None when it cannot be created for lack
    of permission or on a read-only file system (a read-only directory: the
    edit goes on unlocked, as no other editor can write there either)."""
    try:
        return os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except PermissionError:  # another user's lock file: reading is enough for flock
        try:
            return os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
    except OSError as exc:
        if exc.errno == errno.EROFS:
            return None
        directory = os.path.dirname(lock)
        reason = exc.strerror or str(exc)
        if not os.path.isdir(directory):
            shown = directory if os.path.islink(path) else os.path.dirname(path) or os.curdir
            what = "is not a directory" if os.path.lexists(directory) else "does not exist"
            reason = f"the directory {shown!r} {what}"
        raise HostfileError(f"cannot write hostfile {path!r}: {reason}") from None


def _same_file(fd: int, path: str) -> bool:
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


@contextlib.contextmanager
def edit_lock(path: str) -> Iterator[None]:
    """Hold hostfile ``path``'s edit lock (waiting for other editors).

    The lock is ``flock`` on a lock file beside the hostfile (a lock on the
    hostfile itself would be lost to ``os.replace``, and the file may not
    exist yet). The holder removes the lock file before it lets go; a
    waiter that then wakes holding a removed file tries again, so at most
    one editor holds the current one. An editor killed while it holds the
    lock leaves the (empty) lock file behind and the next edit removes it.
    On a file system without ``flock``, and where the lock file cannot be
    created (a read-only directory or file system), the edit goes ahead
    unlocked: reading and "nothing to change" work, and a write that is
    really needed reports its own error.
    """
    lock = _lock_file(path)
    while True:
        fd = _open_lock(path, lock)
        if fd is None:
            yield
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:  # a file system without locks: edit unlocked, as before
                break
            if _same_file(fd, lock):
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock)
        os.close(fd)


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def summary(hostfile: hf.Hostfile) -> str:
    """``N hosts, M slots``."""
    return f"{_plural(len(hostfile), 'host')}, {_plural(hostfile.total_slots, 'slot')}"


def render_table(hostfile: hf.Hostfile) -> str:
    """The hosts as a two-column table with a total line."""
    width = max([len("HOST"), *(len(host) for host in hostfile.hosts)])
    slot_width = max([len("SLOTS"), *(len(str(e.slots)) for e in hostfile.entries)])
    rows = [f"{'HOST':<{width}}  {'SLOTS':>{slot_width}}"]
    rows += [f"{e.host:<{width}}  {e.slots:>{slot_width}}" for e in hostfile.entries]
    rows.append(f"total: {summary(hostfile)}")
    return "\n".join(rows)


def _edit(ctx: click.Context, change: Callable[[str, str], str],
          create: bool = False) -> tuple[str, bool]:
    """Apply ``change(text, path)`` to the hostfile and write it:
    (its path, whether it was created)."""
    path = _hostfile_path(ctx, create=create)
    if not create and not os.path.lexists(path):
        raise HostfileError(f"hostfile {path!r} does not exist")
    with edit_lock(path):
        exists = os.path.lexists(path)
        text = hf.read_hostfile_text(path) if exists or not create else ""
        write_text_atomic(path, change(text, path))
    return path, not exists


_HOSTFILE_HELP = (f"Hostfile to use [default: ./{hf.LOCAL_HOSTFILE}, else "
                  f"{hf.DEFAULT_JOB_HOSTFILE}].")


def hostfile_option(func: F) -> F:
    """-H/--hostfile, accepted on the group and on every subcommand."""
    return click.option("-H", "--hostfile", metavar="PATH", default=None,
                        help=_HOSTFILE_HELP)(func)  # type: ignore[return-value]


# --------------------------------------------------------------------------
# commands


@click.group("hosts", context_settings={"help_option_names": ["-h", "--help"]})
@hostfile_option
@click.pass_context
def hosts(ctx: click.Context, hostfile: str | None) -> None:
    """List, check, format and edit a hostfile (lines of 'HOST slots=N')."""
    # Only this group's context (and its subcommands') gets the options.
    ctx.obj = _HostsOptions(hostfile)


@hosts.command("list")
@hostfile_option
@click.pass_context
@reports_errors
def list_hosts(ctx: click.Context, hostfile: str | None) -> None:
    """Show the hosts and their slots, and the total."""
    click.echo(render_table(hf.load_hostfile(_hostfile_path(ctx, writes=False))))


@hosts.command("add")
@click.argument("host")
@click.option("--slots", type=int, required=True, help="Number of slots (GPUs) on HOST.")
@hostfile_option
@click.pass_context
@reports_errors
def add(ctx: click.Context, host: str, slots: int, hostfile: str | None) -> None:
    """Add HOST with --slots N at the end of the hostfile (creating ./hostfile
    when there is none)."""
    path, created = _edit(ctx, lambda text, path: hf.add_host(text, host, slots, path),
                          create=True)
    if created:
        click.echo(f"created hostfile {path}")
    click.echo(f"added {host} slots={slots} to {path}")
    if created and hostfile is None and _explicit_path(ctx) is None:
        click.echo(f"note: dsrun jobs started in this directory now run on the hosts of "
                   f"{path} (a plain 'dsrun train.py' included); pass -H to use another "
                   f"hostfile, or remove {path} to run on this host only")


@hosts.command("rm")
@click.argument("host")
@hostfile_option
@click.pass_context
@reports_errors
def remove(ctx: click.Context, host: str, hostfile: str | None) -> None:
    """Remove HOST (its line) from the hostfile; not its last host (delete the
    file instead)."""
    written: list[str] = []

    def change(text: str, path: str) -> str:
        changed = hf.remove_host(text, host, path)
        written.append(hf.written_host(text, host, path))
        return changed

    path, _ = _edit(ctx, change)
    click.echo(f"removed {written[0]} from {path}")


@hosts.command("set-slots")
@click.argument("host")
@click.argument("slots", type=int)
@hostfile_option
@click.pass_context
@reports_errors
def set_slots(ctx: click.Context, host: str, slots: int, hostfile: str | None) -> None:
    """Set the number of slots of HOST to SLOTS."""
    written: list[str] = []

    def change(text: str, path: str) -> str:
        changed = hf.set_slots(text, host, slots, path)
        written.append(hf.written_host(text, host, path))
        return changed

    path, _ = _edit(ctx, change)
    click.echo(f"set {written[0]} slots={slots} in {path}")


@hosts.command("validate")
@hostfile_option
@click.pass_context
@reports_errors
def validate(ctx: click.Context, hostfile: str | None) -> None:
    """Check the hostfile; list every problem as PATH:LINE:COL: MESSAGE."""
    path = _hostfile_path(ctx, writes=False)
    text = hf.read_hostfile_text(path)
    problems = hf.hostfile_problems(text, path)
    for problem in problems:
        click.echo(str(problem))
    if problems:
        click.echo(f"{_plural(len(problems), 'problem')} in {path}", err=True)
        ctx.exit(1)
    hostfile = hf.parse_hostfile(text, path)
    if not hostfile.entries:
        click.echo(f"{path}: no hosts defined")
        ctx.exit(1)
    click.echo(f"ok: {summary(hostfile)}")


@hosts.command("fmt")
@click.option("--check", is_flag=True, help="Only report (and diff); exit 1 if not formatted.")
@hostfile_option
@click.pass_context
@reports_errors
def fmt(ctx: click.Context, check: bool, hostfile: str | None) -> None:
    """Normalise lines to 'HOST slots=N', keeping comments, blank lines, order."""
    path = _hostfile_path(ctx, writes=not check)
    if not os.path.lexists(path):
        raise HostfileError(f"hostfile {path!r} does not exist")
    with contextlib.nullcontext() if check else edit_lock(path):
        text, bom = hf.read_hostfile_text_bom(path)  # the text is without it; fmt writes none
        formatted = hf.format_text(text, path)
        if formatted == text and not bom:
            click.echo(f"{path} is already formatted")
            return
        if check:
            diff = difflib.unified_diff(
                text.splitlines(keepends=True), formatted.splitlines(keepends=True), path, path
            )
            click.echo("".join(diff), nl=False)
            why = " (it starts with a UTF-8 byte-order mark)" if bom else ""
            click.echo(f"{path} would be reformatted{why}")
            ctx.exit(1)
        write_text_atomic(path, formatted)
    click.echo(f"formatted {path}")
