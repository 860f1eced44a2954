"""A rank's output cut into lines: \\r ends a line, partial text is flushed,
long lines are cut, the tail shows what a terminal would (pure)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dsrun.launcher.outlines import (
    LINE_LIMIT,
    NEWLINE,
    PARTIAL,
    RETURN,
    LineSplitter,
    Segment,
    Tail,
)


def shown(segments: list[Segment]) -> list[str]:
    return [s.text for s in segments if s.forward]


def test_carriage_return_ends_a_line_and_crlf_is_one_line_end():
    split = LineSplitter()
    assert shown(split.feed(b"\r 10%|#   |")) == []  # waits for a line end or silence
    assert split.pending
    assert shown(split.feed(b"\r 20%|##  |\r")) == [" 10%|#   |", " 20%|##  |"]
    assert shown(split.feed(b"100%\r\nnext\n\nlast\r")) == ["100%", "next", "", "last"]
    assert shown(split.feed(b"\n")) == []  # the \n of \r\n split across two reads
    assert not split.pending


def test_text_without_a_line_end_goes_out_on_flush_and_its_newline_adds_no_line():
    split = LineSplitter()
    split.feed(b"Loading...")
    assert shown(split.flush()) == ["Loading..."]
    assert shown(split.feed(b" done\n")) == [" done"]
    split.feed(b"prompt: ")
    assert shown(split.flush()) == ["prompt: "] and split.flush() == []
    assert shown(split.feed(b"\n\n")) == [""]  # the second newline is an empty line


def test_a_character_cut_by_the_read_is_kept_for_later():
    split = LineSplitter()
    data = "naïve ✓".encode()
    split.feed(data[:-1])
    assert shown(split.flush()) == ["naïve "]
    assert split.pending
    assert shown(split.feed(data[-1:] + b"\n")) == ["✓"]
    split.feed(b"\xe2\x9c")
    assert shown(split.flush(final=True)) == ["\ufffd"]  # end of stream: all of it


def test_an_overlong_line_is_forwarded_in_pieces_and_memory_stays_bounded():
    split = LineSplitter(limit=10)
    out = split.feed(b"x" * 25)
    assert shown(out) == ["x" * 10, "x" * 10] and len(split.buf) == 5
    assert [s.end for s in out] == [PARTIAL, PARTIAL]
    assert shown(split.feed(b"\n")) == ["x" * 5]
    assert shown(split.feed("é".encode() * 6 + b"\n")) == ["ééééé", "é"]  # never mid-char
    big = LineSplitter()
    assert [len(t) for t in shown(big.feed(b"y" * (LINE_LIMIT * 3)))] == [LINE_LIMIT] * 2
    assert len(big.buf) == LINE_LIMIT


@given(st.text(alphabet=st.sampled_from("ab\r\né✓\U0001f600"), max_size=80),
       st.lists(st.integers(0, 400), max_size=8), st.integers(4, 12))
def test_every_character_is_forwarded_once_in_order(text, cuts, limit):
    data = text.encode()
    bounds = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    split = LineSplitter(limit=limit)
    segments = [s for a, b in zip(bounds, bounds[1:]) for s in split.feed(data[a:b])]
    segments += split.flush(final=True)
    assert "".join(s.text + s.end for s in segments) == text
    assert not split.pending


def test_the_tail_shows_the_last_redraw_and_joins_early_text():
    tail = Tail(5)
    split = LineSplitter()
    for chunk in (b"start\n", b"\r 10%", b"\r 50%", b"\r100%\n", b"epoch 1 ..."):
        for segment in split.feed(chunk):
            tail.add(1, segment)
    for segment in split.flush():
        tail.add(1, segment)
    tail.add(2, Segment("on stderr", NEWLINE, True))
    for segment in split.feed(b"done\nboom\n"):
        tail.add(1, segment)
    assert tail.lines() == ["start", "100%", "epoch 1 ...done", "on stderr", "boom"]
    redraw = Tail(5)
    for segment in (Segment(" 10%", RETURN, True), Segment("", RETURN, False),
                    Segment(" 20%", PARTIAL, True), Segment("", RETURN, False),
                    Segment("", NEWLINE, False)):
        redraw.add(1, segment)
    assert redraw.lines() == [" 20%"]
