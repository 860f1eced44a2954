"""A rank's fast exit keeps what plain python keeps: buffered data of files
the script never closed (also a gzip file, whose close writes its trailer)."""

from __future__ import annotations

import gzip

from tests.conftest import run_dsrun

SCRIPT = """
import gzip, os, sys
rank = os.environ["RANK"]
text = open(os.path.join({out!r}, "plain_" + rank + ".txt"), "w")
text.write("x" * 1000 + "\\nlast line\\n")            # < one buffer: all of it is buffered
binary = open(os.path.join({out!r}, "bin_" + rank), "wb")
binary.write(b"y" * 100)
zipped = gzip.open(os.path.join({out!r}, "z_" + rank + ".gz"), "wt") if {gz} else None
if zipped is not None:
    zipped.write("compressed\\n")
{ending}
"""


def _run(tmp_path, ending: str, gz: bool = False, code: int = 0) -> None:
    script = tmp_path / "writer.py"
    script.write_text(SCRIPT.format(out=str(tmp_path), gz=gz, ending=ending))
    ranks = 2 if code == 0 else 1  # a failing rank would stop the other one early
    res = run_dsrun("--cpu", "--num_gpus", str(ranks), "--dist_backend", "none", str(script))
    assert res.returncode == code, res.stderr
    for rank in range(ranks):
        assert (tmp_path / f"plain_{rank}.txt").read_text().endswith("x\nlast line\n")
        assert (tmp_path / f"bin_{rank}").read_bytes() == b"y" * 100
        if gz:
            with gzip.open(tmp_path / f"z_{rank}.gz", "rt") as f:
                assert f.read() == "compressed\n"


def test_unclosed_files_keep_their_buffered_tail(tmp_path):
    _run(tmp_path, "")


def test_unclosed_files_survive_sys_exit(tmp_path):
    _run(tmp_path, "sys.exit(0)")


def test_unclosed_files_survive_a_failing_rank(tmp_path):
    _run(tmp_path, "raise SystemExit(3)", code=3)
    _run(tmp_path, "raise ValueError('boom')", code=1)


def test_an_unclosed_gzip_file_is_complete(tmp_path):
    _run(tmp_path, "", gz=True)
