"""The hostfiles dsrun ships as examples (``hostfiles/example`` and the
README's "Many hosts" sample) are valid and already formatted: a user who
copies one gets a clean ``dsrun hosts fmt --check``, in CI too."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dsrun.launcher import cli
from dsrun.launcher import hostfile as hf

ROOT = Path(__file__).resolve().parents[2]


def readme_sample() -> str:
    """The hostfile printed by ``cat hostfile`` in the README's "Many hosts"
    code block: the lines after it, up to the next command."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("\n## Many hosts\n"):]
    block = re.search(r"```sh\n(.*?)```", section, re.S)
    assert block, "no sh block in the README's Many hosts section"
    lines = block.group(1).splitlines()
    start = lines.index("cat hostfile") + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("dsrun "))
    assert end > start
    return "\n".join(lines[start:end]) + "\n"


@pytest.mark.parametrize("which", ["hostfiles/example", "README.md"])
def test_shipped_hostfiles_pass_fmt_check(which: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = ROOT / which
    if which == "README.md":
        path = tmp_path / "hostfile"
        path.write_text(readme_sample(), encoding="utf-8")
    assert hf.parse_hostfile(path.read_text(encoding="utf-8"), str(path)), which
    assert cli.main(["hosts", "-H", str(path), "fmt", "--check"]) == 0, capsys.readouterr()
    assert "is already formatted" in capsys.readouterr().out
