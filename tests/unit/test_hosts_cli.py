"""`dsrun hosts` subcommands, run in-process with click's CliRunner."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import click
import pytest
from click.testing import CliRunner, Result

from dsrun.errors import HostfileError
from dsrun.launcher import hostfile as hf
from dsrun.launcher import hosts_cli
from dsrun.launcher.hosts_cli import hosts, write_text_atomic

TEXT = "# rack A\nworker-0 slots=8  # big box\n\n# rack B\nworker-1   slots=4\n"


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working directory; the job hostfile points into it (absent)."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(hf, "DEFAULT_JOB_HOSTFILE", str(tmp_path / "job" / "hostfile"))
    return work


def invoke(*args: str) -> Result:
    try:  # click < 8.2 mixes stderr into stdout unless told not to
        runner = CliRunner(mix_stderr=False)  # type: ignore[call-arg]
    except TypeError:
        runner = CliRunner()
    return runner.invoke(hosts, list(args), catch_exceptions=False)


def only_files(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


# --------------------------------------------------------------------------
# list / validate


def test_list_shows_table_and_total(workdir: Path) -> None:
    (workdir / "hostfile").write_text(TEXT)
    result = invoke("list")
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines() == [
        "HOST      SLOTS",
        "worker-0      8",
        "worker-1      4",
        "total: 2 hosts, 12 slots",
    ]


def test_list_uses_job_hostfile_when_no_local_one(workdir: Path) -> None:
    job = Path(hf.DEFAULT_JOB_HOSTFILE)
    job.parent.mkdir()
    job.write_text("node-7 slots=1\n")
    result = invoke("list")
    assert result.exit_code == 0
    assert "node-7" in result.stdout and "total: 1 host, 1 slot" in result.stdout


def test_without_any_hostfile_is_a_usage_error(workdir: Path) -> None:
    result = invoke("list")
    assert result.exit_code == 2
    assert result.stderr.startswith("dsrun: error: no hostfile found")
    assert result.stdout == ""


def test_named_hostfile_must_exist(workdir: Path) -> None:
    (workdir / "hostfile").write_text(TEXT)
    result = invoke("-H", "other", "list")
    assert result.exit_code == 2
    assert result.stderr == "dsrun: error: hostfile 'other' does not exist\n"


def test_list_of_invalid_file_reports_problems(workdir: Path) -> None:
    (workdir / "hf").write_text("a slots=x\n")
    result = invoke("--hostfile", "hf", "list")
    assert result.exit_code == 2
    assert result.stderr == "dsrun: error: hf:1:9: slots must be a positive integer, got 'x'\n"


def test_validate_ok(workdir: Path) -> None:
    (workdir / "hostfile").write_text(TEXT)
    result = invoke("validate")
    assert result.exit_code == 0
    assert result.stdout == "ok: 2 hosts, 12 slots\n"


def test_validate_lists_every_problem(workdir: Path) -> None:
    (workdir / "hf").write_text(
        "# hosts\nabcd slots=x\nw1\nw2 slot=2\nw3 slots=0 junk\nabcd slots=1\nok slots=2\n"
    )
    result = invoke("-H", "hf", "validate")
    assert result.exit_code == 1
    assert result.stdout.splitlines() == [
        "hf:2:12: slots must be a positive integer, got 'x'",
        "hf:3:3: missing 'slots=N' after host 'w1'",
        "hf:4:4: expected 'slots=N' after the host, got 'slot=2'",
        "hf:5:10: slots must be a positive integer, got '0'",
        "hf:5:12: unexpected text after slots: 'junk'",
        "hf:6:1: duplicate host 'abcd' (already on line 2)",
    ]
    assert "6 problems in hf" in result.stderr


def test_validate_reports_a_slot_count_no_host_has(workdir: Path) -> None:
    (workdir / "hostfile").write_text("w1 slots=99999999999999999999\n")
    result = invoke("validate")
    assert result.exit_code == 1
    assert "./hostfile:1:10: slots must be at most 1024" in result.stdout
    assert "ok" not in result.stdout


def test_validate_empty_file_fails(workdir: Path) -> None:
    (workdir / "hostfile").write_text("# nothing yet\n")
    result = invoke("validate")
    assert result.exit_code == 1
    assert "no hosts defined" in result.stdout


# --------------------------------------------------------------------------
# edits


def test_add_creates_local_hostfile_and_says_jobs_will_use_it(workdir: Path) -> None:
    result = invoke("add", "worker-0", "--slots", "8")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "created hostfile ./hostfile"
    assert "dsrun jobs started in this directory now run on the hosts of ./hostfile" \
        in lines[2]
    assert (workdir / "hostfile").read_text() == "worker-0 slots=8\n"
    assert only_files(workdir) == ["hostfile"]
    again = invoke("add", "worker-1", "--slots", "8")
    assert "created" not in again.stdout and "note:" not in again.stdout


@pytest.mark.parametrize("command", [
    ["list"], ["validate"], ["fmt", "--check"], ["add", "worker-9", "--slots", "4"],
    ["rm", "worker-1"], ["set-slots", "worker-1", "3"]])
def test_hostfile_option_after_the_subcommand(workdir: Path, command: list[str]) -> None:
    path = workdir / "elsewhere.txt"
    path.write_text("worker-0 slots=8\nworker-1 slots=4\n")
    for argv in ([*command, "-H", str(path)], ["-H", str(path), *command],
                 [*command, "--hostfile", str(path)]):
        result = invoke(*argv)
        assert result.exit_code == 0, (argv, result.stdout, result.stderr)
        assert str(path) in result.stdout or "ok:" in result.stdout or "worker-0" in \
            result.stdout, argv
        assert not (workdir / "hostfile").exists()  # the named file, not ./hostfile
        path.write_text("worker-0 slots=8\nworker-1 slots=4\n")


def test_hostfile_given_before_and_after_must_agree(workdir: Path) -> None:
    a, b = workdir / "a", workdir / "b"
    a.write_text("worker-0 slots=8\n")
    b.write_text("worker-1 slots=8\n")
    result = invoke("-H", str(a), "list", "-H", str(b))
    assert result.exit_code == 2
    assert "-H/--hostfile given twice with different paths" in result.stderr
    assert invoke("-H", str(a), "list", "-H", str(a)).exit_code == 0


def test_add_rm_set_slots_keep_comments_and_order(workdir: Path) -> None:
    path = workdir / "hostfile"
    path.write_text(TEXT)
    assert invoke("add", "10.0.0.3", "--slots", "2").exit_code == 0
    assert invoke("set-slots", "worker-0", "16").exit_code == 0
    assert invoke("rm", "worker-1").exit_code == 0
    assert path.read_text() == (
        "# rack A\nworker-0 slots=16  # big box\n\n# rack B\n10.0.0.3 slots=2\n"
    )
    assert only_files(workdir) == ["hostfile"]


@pytest.mark.parametrize(
    "args, message",
    [(["add", "worker-1", "--slots", "2"], "host 'worker-1' is already listed"),
     (["add", "new", "--slots", "0"], "slots must be a positive integer, got 0"),
     (["add", "bad!name", "--slots", "1"], "invalid host 'bad!name'"),
     (["rm", "worker-7"], "host 'worker-7' is not in ./hostfile"),
     (["set-slots", "worker-0", "0"], "slots must be a positive integer, got 0"),
     (["set-slots", "nope", "3"], "host 'nope' is not in"),
     (["set-slots", "worker-0", "99999999999999999999"], "slots must be at most 1024"),
     (["add", "w1", "--slots", "99999999999999999999"], "slots must be at most 1024")],
)
def test_invalid_edits_are_refused_and_write_nothing(
    workdir: Path, args: list[str], message: str
) -> None:
    path = workdir / "hostfile"
    path.write_text(TEXT)
    before = path.stat().st_mtime_ns
    result = invoke(*args)
    assert result.exit_code == 2
    assert result.stderr.startswith("dsrun: error: ")
    assert message in result.stderr
    assert path.read_text() == TEXT and path.stat().st_mtime_ns == before
    assert only_files(workdir) == ["hostfile"]


def test_edit_of_invalid_file_is_refused(workdir: Path) -> None:
    path = workdir / "hostfile"
    path.write_text("a slots=1\nb slots=-2\n")
    result = invoke("add", "c", "--slots", "1")
    assert result.exit_code == 2
    assert "refusing to edit ./hostfile" in result.stderr
    assert "./hostfile:2:9: slots must be a positive integer, got '-2'" in result.stderr
    assert path.read_text() == "a slots=1\nb slots=-2\n"


def test_edit_named_file_keeps_mode_and_symlink(workdir: Path) -> None:
    real = workdir / "real"
    real.write_text(TEXT)
    real.chmod(0o640)
    (workdir / "link").symlink_to(real)
    result = invoke("-H", "link", "set-slots", "worker-1", "2")
    assert result.exit_code == 0, result.stderr
    assert (workdir / "link").is_symlink()
    assert real.read_text() == TEXT.replace("slots=4", "slots=2")
    assert stat.S_IMODE(real.stat().st_mode) == 0o640
    assert only_files(workdir) == ["link", "real"]


def _concurrently(count: int, args: list[list[str]]) -> list[int]:
    """Run ``invoke(*args[i])`` in ``count`` forked processes released at
    once; their exit codes."""
    read, write = os.pipe()
    pids = []
    for i in range(count):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child never returns
            code = 99
            try:
                os.close(write)
                os.read(read, 1)
                code = invoke(*args[i]).exit_code
            finally:
                os._exit(code)
        pids.append(pid)
    os.close(read)
    os.write(write, b"x" * count)
    os.close(write)
    return [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]


@pytest.mark.proc
@pytest.mark.parametrize("existing", [True, False])
def test_concurrent_edits_all_land(workdir: Path, monkeypatch: pytest.MonkeyPatch,
                                   existing: bool) -> None:
    """Hosts adding themselves to one hostfile at once (also when it does
    not exist yet): each edit is read-change-write under the edit lock, so
    none is lost. The change is slowed down so that, without the lock,
    every editor would read the file before any of them wrote it."""
    import time

    slow_add = hf.add_host

    def add_host(*args: object, **kwargs: object) -> str:
        time.sleep(0.15)
        return slow_add(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(hf, "add_host", add_host)
    path = workdir / "hostfile"
    if existing:
        path.write_text("a slots=1\n")
    codes = _concurrently(5, [["add", f"h{i}", "--slots", "1"] for i in range(5)])
    assert codes == [0] * 5
    hosts_now = hf.load_hostfile(str(path)).hosts
    assert sorted(hosts_now) == sorted(["a"] * existing + [f"h{i}" for i in range(5)])
    assert only_files(workdir) == ["hostfile"]  # no lock or temporary file left


def test_a_stale_lock_file_is_taken_over_and_removed(workdir: Path) -> None:
    """An editor killed while editing leaves its lock file; the next edit
    takes it (no process holds its flock any more) and removes it."""
    (workdir / "hostfile").write_text(TEXT)
    (workdir / ".hostfile.lock").write_text("")
    assert invoke("set-slots", "worker-1", "2").exit_code == 0
    assert only_files(workdir) == ["hostfile"]


@pytest.mark.parametrize("code", [errno.EPERM, errno.EACCES, errno.EROFS],
                         ids=["EPERM", "EACCES", "EROFS"])
def test_a_read_only_directory_needs_no_lock_for_what_writes_nothing(
        workdir: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    """Where no file can be created (chattr +i, a read-only mount), fmt of a
    formatted file and rm of an absent host answer as in a writable
    directory (no lock file is needed); a real change reports the write."""
    (workdir / "hostfile").write_text(TIDY)
    real_open = os.open

    def read_only(path: str, flags: int, *args: int, **kwargs: int) -> int:
        if flags & os.O_CREAT and os.path.dirname(os.path.abspath(path)) == str(workdir):
            raise OSError(code, os.strerror(code), path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    result = invoke("fmt")
    assert (result.exit_code, result.stdout) == (0, "./hostfile is already formatted\n")
    result = invoke("rm", "zzz")
    assert result.exit_code == 2 and "'zzz' is not in" in result.stderr, result.stderr
    result = invoke("rm", "worker-1")
    assert result.exit_code == 2
    assert result.stderr == (f"dsrun: error: cannot write hostfile './hostfile': "
                             f"{os.strerror(code)}\n")
    assert invoke("list").exit_code == 0
    assert (workdir / "hostfile").read_text() == TIDY and only_files(workdir) == ["hostfile"]


def test_editing_in_a_missing_directory_names_it(workdir: Path) -> None:
    result = invoke("add", "x", "--slots", "1", "-H", "nodir/hostfile")
    assert result.exit_code == 2
    assert result.stderr == ("dsrun: error: cannot write hostfile 'nodir/hostfile': the "
                             "directory 'nodir' does not exist\n")
    result = invoke("rm", "x", "-H", "nodir/hostfile")
    assert result.stderr == "dsrun: error: hostfile 'nodir/hostfile' does not exist\n"
    assert only_files(workdir) == []


# --------------------------------------------------------------------------
# fmt


MESSY = "# rack A\nworker-0    slots=8   # big\n\n   worker-1\tslots=04\n\n\n"
TIDY = "# rack A\nworker-0 slots=8 # big\n\nworker-1 slots=4\n"


def test_fmt_check_reports_without_writing(workdir: Path) -> None:
    path = workdir / "hostfile"
    path.write_text(MESSY)
    result = invoke("fmt", "--check")
    assert result.exit_code == 1
    assert "-worker-0    slots=8   # big" in result.stdout
    assert "+worker-0 slots=8 # big" in result.stdout
    assert "would be reformatted" in result.stdout
    assert path.read_text() == MESSY


def test_fmt_rewrites_then_is_stable(workdir: Path) -> None:
    path = workdir / "hostfile"
    path.write_text(MESSY)
    assert invoke("fmt").exit_code == 0
    assert path.read_text() == TIDY
    again = invoke("fmt", "--check")
    assert again.exit_code == 0 and "already formatted" in again.stdout
    assert only_files(workdir) == ["hostfile"]


# --------------------------------------------------------------------------
# atomic write and error helper


def test_failed_write_leaves_old_file_and_no_temp(workdir: Path, monkeypatch) -> None:
    path = workdir / "hostfile"
    path.write_text(TEXT)

    def broken_replace(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(HostfileError, match="cannot write hostfile .*No space left"):
        write_text_atomic(str(path), "x slots=1\n")
    assert path.read_text() == TEXT
    assert only_files(workdir) == ["hostfile"]


def test_write_into_missing_directory_is_a_hostfile_error(workdir: Path) -> None:
    with pytest.raises(HostfileError, match="cannot write hostfile"):
        write_text_atomic(str(workdir / "no" / "hostfile"), "a slots=1\n")


def test_new_file_gets_umask_mode(workdir: Path) -> None:
    old = os.umask(0o027)
    try:
        write_text_atomic(str(workdir / "new"), "a slots=1\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE((workdir / "new").stat().st_mode) == 0o640


def test_reports_errors_exit_code_and_format() -> None:
    @click.command()
    @hosts_cli.reports_errors
    def boom() -> None:
        raise HostfileError("bad things")

    result = CliRunner().invoke(boom, [])
    assert result.exit_code == 2
    assert "dsrun: error: bad things" in result.output


def test_host_with_a_port_says_ports_go_in_ssh_config():
    """`dsrun hosts add node5:22` said "not a valid IPv6 address"."""
    from dsrun.launcher.hostfile import host_problem

    assert host_problem("node5:22") == ("HOST:PORT is not supported (put the port in "
                                        "ssh_config: 'Host node5' / 'Port 22', or pass "
                                        "--ssh_port)")
    assert host_problem("fe80::1") is None
    assert host_problem("a:b") == "not a valid IPv6 address"


# --------------------------------------------------------------------------
# the last host, the file's spelling, loopback twice, -H /dev/null


def test_rm_of_the_last_host_is_refused_and_the_file_kept(workdir: Path) -> None:
    assert invoke("add", "w", "--slots", "2").exit_code == 0
    result = invoke("rm", "w")
    assert result.exit_code == 2
    assert result.stderr == ("dsrun: error: 'w' is the last host of ./hostfile, and a hostfile "
                             "without hosts is refused by every job: delete ./hostfile instead "
                             "(jobs then run on this host only, unless another hostfile is "
                             "found)\n")
    assert (workdir / "hostfile").read_text() == "w slots=2\n"
    assert invoke("validate").exit_code == 0


def test_rm_and_set_slots_name_the_host_as_the_file_spells_it(workdir: Path) -> None:
    (workdir / "hostfile").write_text("worker-0 slots=1\nWorker-1 slots=2\n")
    assert invoke("set-slots", "WORKER-1", "3").stdout == "set Worker-1 slots=3 in ./hostfile\n"
    assert invoke("rm", "worker-1").stdout == "removed Worker-1 from ./hostfile\n"


def test_add_and_validate_catch_this_machine_twice(workdir: Path) -> None:
    path = workdir / "hostfile"
    path.write_text("localhost slots=1\nw slots=1\n")
    result = invoke("add", "127.0.0.1", "--slots", "1")
    assert result.exit_code == 2
    assert "host '127.0.0.1' is this machine, as 'localhost' on line 1 is" in result.stderr
    path.write_text("localhost slots=1\n::1 slots=1\n")
    result = invoke("validate")
    assert result.exit_code == 1
    assert result.stdout.startswith("./hostfile:2:1: host '::1' is this machine")


@pytest.mark.parametrize("args", [["list"], ["add", "w", "--slots", "1"], ["rm", "w"],
                                  ["validate"], ["fmt"]])
def test_dev_null_is_no_hostfile_to_edit(workdir: Path, args: list[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from dsrun.launcher import hosts_cli

    def refuse(*_: object, **__: object) -> None:
        # as root, a regression here would replace the machine's /dev/null
        raise AssertionError("hosts tried to write -H /dev/null")

    monkeypatch.setattr(hosts_cli, "AtomicFile", refuse)
    result = invoke("-H", os.devnull, *args)
    assert result.exit_code == 2
    assert "-H /dev/null means no hostfile" in result.stderr
    assert not (workdir / "hostfile").exists()


def test_fmt_check_flags_a_byte_order_mark_and_fmt_drops_it(workdir: Path) -> None:
    path = workdir / "hostfile"
    path.write_bytes(b"\xef\xbb\xbfworker-0 slots=2\n")
    result = invoke("fmt", "--check")
    assert result.exit_code == 1
    assert result.stdout.endswith("./hostfile would be reformatted (it starts with a UTF-8 "
                                  "byte-order mark)\n")
    assert invoke("fmt").stdout == "formatted ./hostfile\n"
    assert path.read_bytes() == b"worker-0 slots=2\n"
    assert invoke("fmt", "--check").stdout == "./hostfile is already formatted\n"


@pytest.mark.timeout(10)  # reading the FIFO, as before, waits for a writer forever
def test_an_edit_never_replaces_a_fifo_or_device(workdir: Path) -> None:
    fifo = workdir / "pipe"
    os.mkfifo(fifo)
    result = invoke("-H", str(fifo), "add", "w", "--slots", "1")
    assert result.exit_code == 2
    assert "is not a regular file (a pipe); refusing to edit it" in result.stderr
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("command", [("fmt",), ("fmt", "--check"), ("validate",), ("list",)])
def test_a_device_is_refused_and_only_writers_refuse_a_pipe(workdir: Path,
                                                            command: tuple[str, ...]) -> None:
    """fmt replaced a FIFO with a regular file once fed. A
    command that writes refuses a pipe; one that only reads takes it, as a
    job does (``-H <(cmd)``); a device is refused by every command, also as
    ./hostfile found by default."""
    import threading

    result = invoke(*command, "-H", "/dev/zero")
    assert result.exit_code == 2
    assert "is not a regular file (a device); refusing to" in result.stderr
    fifo = workdir / "pipe"
    os.mkfifo(fifo)
    writes = command == ("fmt",)

    def feed() -> None:
        with open(fifo, "w") as out:
            out.write("worker-1 slots=2\n")

    if not writes:
        threading.Thread(target=feed, daemon=True).start()
    result = invoke("-H", str(fifo), *command)
    if writes:
        assert result.exit_code == 2
        assert "is not a regular file (a pipe); refusing to edit it" in result.stderr
    else:
        assert result.exit_code == 0, result.stderr
        assert "worker-1" in result.stdout or "ok: 1 host" in result.stdout \
            or "already formatted" in result.stdout
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    os.remove(fifo)
    os.symlink("/dev/zero", workdir / "hostfile")
    assert "'./hostfile' is not a regular file" in invoke(*command).stderr


def test_fmt_reads_the_hostfile_once(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """the BOM check opened the file a second time."""
    import builtins

    path = workdir / "hostfile"
    path.write_bytes(b"\xef\xbb\xbfworker-0   slots=2\n")
    opened: list[str] = []
    real_open = builtins.open

    def counting_open(file, *args, **kwargs):  # type: ignore[no-untyped-def]
        if os.path.basename(str(file)) == "hostfile":
            opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting_open)
    result = invoke("fmt", "--check")
    assert result.exit_code == 1 and "(it starts with a UTF-8 byte-order mark)" in result.stdout
    assert opened == ["./hostfile"]
    assert hf.read_hostfile_text_bom(str(path)) == ("worker-0   slots=2\n", True)
    path.write_bytes(b"\xef\xbb\xbfw slots=1\xff\n")
    with pytest.raises(HostfileError, match="bad byte at offset 12"):
        hf.read_hostfile_text(str(path))
