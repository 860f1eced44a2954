"""Hostfile parsing, validation, path resolution and pure text edits."""

from __future__ import annotations

import os

import pytest

from dsrun.errors import HostfileError
from dsrun.launcher import hostfile as hf
from dsrun.launcher.hostfile import (
    MAX_SLOTS,
    HostEntry,
    Hostfile,
    add_host,
    format_text,
    host_key,
    host_problem,
    hostfile_problems,
    load_hostfile,
    parse_hostfile,
    remove_host,
    resolve_hostfile,
    set_slots,
)

# --------------------------------------------------------------------------
# valid files

VALID = [
    pytest.param("", [], id="empty"),
    pytest.param("# only a comment\n\n   \n", [], id="comments-and-blanks"),
    pytest.param("worker-0 slots=8\n", [("worker-0", 8, 1)], id="one-host"),
    pytest.param("worker-0 slots=8", [("worker-0", 8, 1)], id="no-final-newline"),
    pytest.param(
        "# cluster\n\nworker-0 slots=8\n  worker-1\tslots=4   # spare\n",
        [("worker-0", 8, 3), ("worker-1", 4, 4)],
        id="comments-indent-tabs",
    ),
    pytest.param("a slots=1#no space\n", [("a", 1, 1)], id="comment-without-space"),
    pytest.param("10.0.0.1 slots=2\n", [("10.0.0.1", 2, 1)], id="ipv4"),
    pytest.param("fe80::1 slots=2\n::1 slots=1\n", [("fe80::1", 2, 1), ("::1", 1, 2)], id="ipv6"),
    pytest.param("fe80::1%eth0 slots=2\n", [("fe80::1%eth0", 2, 1)], id="ipv6-scope"),
    pytest.param("node.example.COM slots=16\n", [("node.example.COM", 16, 1)], id="fqdn"),
    pytest.param("123 slots=1\n", [("123", 1, 1)], id="numeric-label"),
    pytest.param("a slots=08\n", [("a", 8, 1)], id="leading-zero-slots"),
    pytest.param("a slots=1\r\nb slots=2\r\n", [("a", 1, 1), ("b", 2, 2)], id="crlf"),
]


@pytest.mark.parametrize("text, expected", VALID)
def test_valid_hostfiles(text: str, expected: list[tuple[str, int, int]]) -> None:
    parsed = parse_hostfile(text, "hf")
    assert [(e.host, e.slots, e.line) for e in parsed.entries] == expected
    assert parsed.path == "hf"
    assert hostfile_problems(text, "hf") == []


# --------------------------------------------------------------------------
# invalid files: every problem with its line and column

INVALID = [
    pytest.param("a slots=x\n", [(1, 9, "slots must be a positive integer, got 'x'")], id="x"),
    pytest.param("a slots=\n", [(1, 9, "slots must be a positive integer, got ''")], id="empty"),
    pytest.param("a slots=0\n", [(1, 9, "got '0'")], id="zero"),
    pytest.param("a slots=-1\n", [(1, 9, "got '-1'")], id="negative"),
    pytest.param("a slots=1.5\n", [(1, 9, "got '1.5'")], id="float"),
    pytest.param("a slots=\u0661\n", [(1, 9, "positive integer")], id="non-ascii-digit"),
    pytest.param("a slot=2\n", [(1, 3, "expected 'slots=N' after the host, got 'slot=2'")],
                 id="slot-typo"),
    pytest.param("a Slots=2\n", [(1, 3, "got 'Slots=2'")], id="capitalised"),
    pytest.param("a slots = 2\n", [(1, 3, "got 'slots'"), (1, 9, "unexpected text after")],
                 id="spaced-equals"),
    pytest.param("\nworker-0\n", [(2, 9, "missing 'slots=N' after host 'worker-0'")],
                 id="missing-slots"),
    pytest.param("worker-0 # slots=2\n", [(1, 9, "missing 'slots=N'")], id="slots-in-comment"),
    pytest.param("a slots=2 gpus=8\n", [(1, 11, "unexpected text after slots: 'gpus=8'")],
                 id="trailing-junk"),
    pytest.param("a slots=" + "9" * 5000 + "\n",
                 [(1, 9, "slots must be at most 1024 (no host runs more ranks), got a "
                         "5000-digit number")], id="thousands-of-digits"),
    pytest.param("a slots=2 max_slots=4\n",
                 [(1, 11, "'max_slots=4' (Open MPI's max_slots= is not a hostfile key")],
                 id="open-mpi-max-slots"),
    pytest.param("a slots=2 b c # ok\n", [(1, 11, "'b c'")], id="junk-before-comment"),
    pytest.param("a slots=1\nb slots=1\nA slots=2\n",
                 [(3, 1, "duplicate host 'A' (already on line 1 as 'a')")], id="duplicate-case"),
    pytest.param("::1 slots=1\n0:0::1 slots=1\n", [(2, 1, "duplicate host '0:0::1'")],
                 id="duplicate-ipv6"),
    pytest.param("a slots=1\n  a slots=2\n", [(2, 3, "duplicate host 'a' (already on line 1)")],
                 id="duplicate-indented"),
    pytest.param("bad!host slots=1\n", [(1, 1, "invalid host 'bad!host'")], id="bang"),
    pytest.param("-a slots=1\n", [(1, 1, "must not start or end with '-'")], id="leading-dash"),
    pytest.param("a..b slots=1\n", [(1, 1, "empty label")], id="empty-label"),
    pytest.param("a.. slots=1\n", [(1, 1, "empty label")], id="two-trailing-dots"),
    pytest.param(f"{'x' * 64} slots=1\n", [(1, 1, "longer than 63")], id="long-label"),
    pytest.param(f"{'abc.' * 64}d slots=1\n", [(1, 1, "longer than 253")], id="long-name"),
    pytest.param("10.0.0.256 slots=1\n", [(1, 1, "not a valid IPv4 address")], id="bad-ipv4"),
    pytest.param("fe80:::1 slots=1\n", [(1, 1, "not a valid IPv6 address")], id="bad-ipv6"),
    pytest.param("[::1] slots=1\n", [(1, 1, "without brackets")], id="bracketed-ipv6"),
    pytest.param("slots=4\n", [(1, 1, "invalid host 'slots=4'"), (1, 8, "missing")],
                 id="no-host"),
    pytest.param("localhost slots=99999999999999999999\n",
                 [(1, 17, "slots must be at most 1024 (no host runs more ranks), got "
                          "99999999999999999999")], id="slots-overflow"),
    pytest.param("localhost slots=30000000\n", [(1, 17, "at most 1024")], id="slots-huge"),
    pytest.param("localhost slots=1025\n", [(1, 17, "at most 1024")], id="slots-over-max"),
]


@pytest.mark.parametrize("text, expected", INVALID)
def test_invalid_hostfiles(text: str, expected: list[tuple[int, int, str]]) -> None:
    problems = hostfile_problems(text, "hf")
    assert [(p.line, p.col) for p in problems] == [(line, col) for line, col, _ in expected]
    for problem, (_, _, fragment) in zip(problems, expected):
        assert problem.path == "hf"
        assert fragment in problem.message
    with pytest.raises(HostfileError) as info:
        parse_hostfile(text, "hf")
    assert str(info.value).splitlines() == [str(p) for p in problems]


def test_the_most_slots_parse() -> None:
    assert parse_hostfile("a slots=1024\n", "hf").total_slots == MAX_SLOTS == 1024
    with pytest.raises(HostfileError, match="slots of host 'a' must be at most 1024"):
        HostEntry("a", 1025, 1)


def test_problem_message_format() -> None:
    text = "# nodes\nworker-0 slots=2\nabcd slots=x\n"
    assert [str(p) for p in hostfile_problems(text, "hostfile")] == [
        "hostfile:3:12: slots must be a positive integer, got 'x'"
    ]


def test_all_problems_reported_in_file_order() -> None:
    text = "a slots=x\nb\nc slots=1 junk\na slots=2\n-x slots=1\n"
    problems = hostfile_problems(text, "p")
    assert [(p.line, p.col) for p in problems] == [(1, 9), (2, 2), (3, 11), (4, 1), (5, 1)]
    with pytest.raises(HostfileError) as info:
        parse_hostfile(text, "p")
    assert len(str(info.value).splitlines()) == 5
    assert str(info.value).startswith("p:1:9: ")


# --------------------------------------------------------------------------
# data objects and host names


def test_hostfile_lookup_helpers() -> None:
    parsed = parse_hostfile("Worker-0 slots=8\n0::1 slots=2\nw1 slots=4\n", "hf")
    assert parsed.hosts == ("Worker-0", "0::1", "w1")
    assert parsed.total_slots == 14
    assert len(parsed) == 3
    assert parsed.get("worker-0") == HostEntry("Worker-0", 8, 1)
    assert parsed.get("::1") == HostEntry("0::1", 2, 2)
    assert parsed.get("w2") is None
    assert "W1" in parsed and "w2" not in parsed and 3 not in parsed


def test_hostfile_rejects_bad_data_at_construction() -> None:
    with pytest.raises(HostfileError, match="duplicate host 'A'.*lines 1 and 2"):
        Hostfile("hf", (HostEntry("a", 1, 1), HostEntry("A", 1, 2)))
    with pytest.raises(HostfileError, match="positive integer"):
        HostEntry("a", 0, 1)
    with pytest.raises(HostfileError, match="positive integer"):
        HostEntry("a", True, 1)
    with pytest.raises(HostfileError, match="invalid host"):
        HostEntry("a b", 1, 1)


def test_local_hostfile() -> None:
    local = hf.local_hostfile(3)
    assert local.hosts == ("localhost",) and local.total_slots == 3


@pytest.mark.parametrize(
    "host, ok",
    [("worker-0", True), ("a1.b2.c3", True), ("192.168.1.10", True), ("2001:db8::7", True),
     ("a_b", True), ("gpu_node_1.cluster", True), ("_a", True), ("a-", False),
     ("-a", False), ("a!b", False), ("1.2.3", False), ("1.2.3.4.5", False), ("", False),
     ("Ä", False), ("a:b", False)],
)
def test_host_problem(host: str, ok: bool) -> None:
    assert (host_problem(host) is None) is ok


def test_host_key() -> None:
    assert host_key("Node-1.Example") == host_key("node-1.example")
    assert host_key("2001:DB8:0::1") == host_key("2001:db8::1")
    assert host_key("a") != host_key("b")


# --------------------------------------------------------------------------
# files


def test_load_hostfile(tmp_path) -> None:
    path = tmp_path / "hf"
    path.write_bytes(b"\xef\xbb\xbfa slots=2\r\n# x\r\nb slots=3\r\n")
    loaded = load_hostfile(str(path))
    assert loaded.path == str(path)
    assert [(e.host, e.slots, e.line) for e in loaded.entries] == [("a", 2, 1), ("b", 3, 3)]


def test_load_hostfile_errors_name_the_path(tmp_path) -> None:
    missing = str(tmp_path / "nope")
    with pytest.raises(HostfileError, match=f"hostfile '{missing}' does not exist"):
        load_hostfile(missing)
    with pytest.raises(HostfileError, match="is a directory"):
        load_hostfile(str(tmp_path))
    binary = tmp_path / "bin"
    binary.write_bytes(b"a slots=1\n\xff\xfe\n")
    with pytest.raises(HostfileError, match="not UTF-8 text"):
        load_hostfile(str(binary))
    bad = tmp_path / "bad"
    bad.write_text("a slots=1\nb slots=z\n")
    with pytest.raises(HostfileError, match=f"^{bad}:2:9: "):
        load_hostfile(str(bad))


@pytest.fixture
def job_hostfile(tmp_path, monkeypatch):
    """Point DEFAULT_JOB_HOSTFILE into tmp_path (not created)."""
    path = tmp_path / "job" / "hostfile"
    monkeypatch.setattr(hf, "DEFAULT_JOB_HOSTFILE", str(path))
    return path


def test_resolve_explicit_must_exist(tmp_path, job_hostfile) -> None:
    (tmp_path / "hostfile").write_text("local slots=1\n")
    job_hostfile.parent.mkdir()
    job_hostfile.write_text("job slots=1\n")
    with pytest.raises(HostfileError, match="does not exist"):
        resolve_hostfile("missing", str(tmp_path))
    with pytest.raises(HostfileError, match="empty"):
        resolve_hostfile("", str(tmp_path))


def test_resolve_explicit_relative_to_cwd(tmp_path, job_hostfile) -> None:
    (tmp_path / "mine").write_text("mine slots=2\n")
    resolved = resolve_hostfile("mine", str(tmp_path))
    assert resolved is not None and resolved.hosts == ("mine",)
    absolute = resolve_hostfile(str(tmp_path / "mine"), "/")
    assert absolute is not None and absolute.path == str(tmp_path / "mine")


def test_resolve_prefers_cwd_then_job(tmp_path, job_hostfile) -> None:
    assert resolve_hostfile(None, str(tmp_path)) is None
    job_hostfile.parent.mkdir()
    job_hostfile.write_text("job slots=1\n")
    found = resolve_hostfile(None, str(tmp_path))
    assert found is not None and found.hosts == ("job",)
    (tmp_path / "hostfile").write_text("local slots=1\n")
    found = resolve_hostfile(None, str(tmp_path))
    assert found is not None and found.hosts == ("local",)
    assert found.path == os.path.join(str(tmp_path), "hostfile")


def test_resolve_invalid_default_is_an_error_not_a_fallback(tmp_path, job_hostfile) -> None:
    job_hostfile.parent.mkdir()
    job_hostfile.write_text("job slots=1\n")
    (tmp_path / "hostfile").write_text("local slots=0\n")
    with pytest.raises(HostfileError, match=r"hostfile:1:13: slots must be"):
        resolve_hostfile(None, str(tmp_path))


# --------------------------------------------------------------------------
# pure edits

TEXT = "# cluster A\n\nworker-0 slots=8   # big\n# spare below\nworker-1\tslots=4\n\n"


def test_add_host_keeps_comments_and_goes_before_trailing_blanks() -> None:
    assert add_host(TEXT, "worker-2", 2) == (
        "# cluster A\n\nworker-0 slots=8   # big\n# spare below\nworker-1\tslots=4\n"
        "worker-2 slots=2\n\n"
    )
    assert add_host("", "a", 1) == "a slots=1\n"
    assert add_host("a slots=1", "b", 2) == "a slots=1\nb slots=2\n"
    assert add_host("a slots=1\r\n", "b", 2) == "a slots=1\r\nb slots=2\r\n"


@pytest.mark.parametrize(
    "host, slots, message",
    [("WORKER-0", 2, r"hf:3: host 'worker-0' is already listed \(slots=8\)"),
     ("bad!host", 2, "invalid host 'bad!host'"),
     ("w9", 0, "slots must be a positive integer, got 0"),
     ("w9", -3, "got -3"),
     ("w9", 99999999999999999999, "slots must be at most 1024"),
     ("w9", 1025, "slots must be at most 1024 .*got 1025")],
)
def test_add_host_refuses_invalid_result(host: str, slots: int, message: str) -> None:
    with pytest.raises(HostfileError, match=message):
        add_host(TEXT, host, slots, "hf")


def test_remove_host() -> None:
    assert remove_host(TEXT, "worker-0") == (
        "# cluster A\n\n# spare below\nworker-1\tslots=4\n\n"
    )
    with pytest.raises(HostfileError, match=r"host 'worker-9' is not in hf \(did you mean"):
        remove_host(TEXT, "worker-9", "hf")


def test_set_slots_changes_only_the_number() -> None:
    assert set_slots(TEXT, "Worker-0", 16) == TEXT.replace("slots=8", "slots=16")
    assert set_slots(TEXT, "worker-1", 1) == TEXT.replace("\tslots=4", "\tslots=1")
    with pytest.raises(HostfileError, match="got 0"):
        set_slots(TEXT, "worker-0", 0)
    with pytest.raises(HostfileError, match="not in"):
        set_slots(TEXT, "nope", 1)


def test_format_text() -> None:
    messy = "  # header  \n\n  worker-0    slots=08#c\n   \nworker-1\tslots=4  \n\n\n"
    assert format_text(messy) == "# header\n\nworker-0 slots=8 #c\n\nworker-1 slots=4\n"
    assert format_text(format_text(messy)) == format_text(messy)
    assert format_text("") == ""


@pytest.mark.parametrize("edit", [
    lambda t: add_host(t, "c", 1, "hf"),
    lambda t: remove_host(t, "a", "hf"),
    lambda t: set_slots(t, "a", 2, "hf"),
    lambda t: format_text(t, "hf"),
])
def test_edits_refuse_an_invalid_file(edit) -> None:
    with pytest.raises(HostfileError, match=r"refusing to edit hf.*\nhf:2:9: slots must be"):
        edit("a slots=1\nb slots=x\n")


# --------------------------------------------------------------------------
# no hosts left, loopback twice, "no hostfile" and files found automatically


def test_remove_the_last_host_is_refused_saying_to_delete_the_file() -> None:
    with pytest.raises(HostfileError, match=r"'w' is the last host of hf, .*delete hf instead"):
        remove_host("# only one\nw slots=2  # box\n", "W", "hf")
    assert remove_host("a slots=1\nb slots=1\n", "a") == "b slots=1\n"


def test_written_host_is_the_files_spelling() -> None:
    assert hf.written_host(TEXT, "WORKER-1") == "worker-1"


@pytest.mark.parametrize("first, second", [
    ("localhost", "127.0.0.1"), ("127.0.0.1", "::1"), ("LocalHost", "127.1.2.3"),
    ("::1", "localhost.localdomain")])
def test_two_loopback_spellings_are_a_problem_and_add_refuses_them(first, second) -> None:
    text = f"{first} slots=1\nw slots=1\n"
    with pytest.raises(HostfileError, match=rf"hf:1: host '{second}' is this machine, as "
                                            rf"'{first}' on line 1 is \(both loopback\)"):
        add_host(text, second, 1, "hf")
    problems = hostfile_problems(text + f"{second} slots=2\n", "hf")
    assert [(p.line, p.col) for p in problems] == [(3, 1)]
    assert "this machine" in problems[0].message
    # jobs parse it (they refuse it when both are selected, with the cluster check)
    assert len(parse_hostfile(text + f"{second} slots=2\n", "hf")) == 3


def test_dev_null_is_the_explicit_no_hostfile(tmp_path, job_hostfile) -> None:
    (tmp_path / "hostfile").write_text("worker-0 slots=2\n")
    assert resolve_hostfile(os.devnull, str(tmp_path)) is None
    assert hf.is_no_hostfile("/dev/../dev/null") and not hf.is_no_hostfile(None)
    with pytest.raises(HostfileError, match="/none' does not exist"):
        resolve_hostfile("none", str(tmp_path))  # a word is a file name, as any other


@pytest.mark.parametrize("make, what", [
    (lambda p: p.mkdir(), "is a directory, not a file"),
    (lambda p: p.symlink_to("nowhere"), "is a symbolic link to 'nowhere', which does not exist"),
])
def test_unreadable_hostfile_found_automatically_says_so(tmp_path, job_hostfile, make,
                                                         what) -> None:
    make(tmp_path / "hostfile")
    with pytest.raises(HostfileError) as info:
        resolve_hostfile(None, str(tmp_path))
    message = str(info.value)
    assert what in message
    assert f"found automatically in the working directory {tmp_path}, not named with -H" \
        in message
    assert "-H /dev/null to run on this host only" in message


def test_unreadable_job_hostfile_names_it(tmp_path, job_hostfile) -> None:
    job_hostfile.mkdir(parents=True)
    with pytest.raises(HostfileError, match=r"is a directory, not a file \(the job hostfile, "
                                            r"used when ./hostfile is absent"):
        resolve_hostfile(None, str(tmp_path))
