"""The node agent's reader of a rank's pipe (agent_output.RankOutput._pump)
with a real pipe and a writer thread: text without a line end goes out at
most PARTIAL_IDLE after its first byte however much more of it follows,
and a whole line that arrives in two writes close together stays one line."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from dsrun.launcher.agent_output import Rank, RankOutput
from dsrun.launcher.outlines import PARTIAL_IDLE


class Recorder:
    """A link that keeps each ``out`` event with the time it was sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[float, list[str]]] = []

    def send(self, obj: dict[str, Any], control: bool = True) -> None:
        self.sent.append((time.monotonic(), list(obj["lines"])))


def _pump(write: Any) -> tuple[float, Recorder]:
    """Run the reader over a pipe that ``write(fd)`` writes (then closes);
    return when the writer began and what was forwarded."""
    link = Recorder()
    output = RankOutput(link, lambda message: None, lambda exc: None)  # type: ignore[arg-type]
    rank = Rank(0, 0, None, None, "", "")  # type: ignore[arg-type]
    r, w = os.pipe()
    began = time.monotonic()

    def writer() -> None:
        try:
            write(w)
        finally:
            os.close(w)

    thread = threading.Thread(target=writer)
    thread.start()
    output._pump(rank, 1, os.fdopen(r, "rb", buffering=0))
    thread.join()
    return began, link


def test_a_trickle_of_dots_is_forwarded_while_it_lasts():
    steps, step = 30, 0.05  # a dot every 50 ms for 1.5 s: never PARTIAL_IDLE of silence

    def dots(w: int) -> None:
        os.write(w, b"epoch 1 ")
        for _ in range(steps):
            time.sleep(step)
            os.write(w, b".")
        os.write(w, b" done\n")

    began, link = _pump(dots)
    first_time, first_lines = link.sent[0]
    assert first_lines[0].startswith("epoch 1 ")
    # Held at most PARTIAL_IDLE (plus scheduling slack), not until the line ends.
    assert first_time - began < PARTIAL_IDLE + 0.5 < steps * step, link.sent
    text = "".join(line for _, lines in link.sent for line in lines)
    assert text == "epoch 1 " + "." * steps + " done"  # every byte once, in order
    assert len(link.sent) >= 3  # pieces went out while the dots came


def test_a_line_written_in_two_pieces_close_together_stays_one_line():
    def halves(w: int) -> None:
        for i in range(20):
            os.write(w, f"line {i} first half, ".encode())
            time.sleep(0.01)
            os.write(w, f"second half {i}\n".encode())

    _, link = _pump(halves)
    lines = [line for _, lines in link.sent for line in lines]
    assert lines == [f"line {i} first half, second half {i}" for i in range(20)]
