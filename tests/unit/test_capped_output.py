"""`CappedOutput`: head + tail of a stream within a byte cap, whatever the chunking."""

from __future__ import annotations

import itertools
import tracemalloc

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omniloop.sandboxes.base import TRUNCATION_MARKER
from omniloop.sandboxes.output import CappedOutput


def expected_text(data: bytes, cap: int) -> str:
    """What head + tail capture must return for `data`, computed from the whole stream."""
    if len(data) <= cap:
        return data.decode("utf-8", errors="replace")
    head, tail = data[: cap // 2], data[len(data) - (cap - cap // 2) :]
    marker = TRUNCATION_MARKER.format(n=len(data) - cap)
    return head.decode("utf-8", errors="replace") + marker + tail.decode("utf-8", errors="replace")


def test_short_output_is_kept_whole() -> None:
    out = CappedOutput(16)
    out.feed(b"hello ")
    out.feed(b"world")

    assert out.text() == "hello world"
    assert not out.truncated
    assert out.total == 11


def test_output_of_exactly_the_cap_is_not_truncated() -> None:
    out = CappedOutput(10)
    out.feed(b"0123456789")

    assert out.text() == "0123456789"
    assert not out.truncated


def test_one_byte_over_the_cap_keeps_head_and_tail_with_a_marker() -> None:
    out = CappedOutput(10)
    out.feed(b"01234")
    out.feed(b"56789A")

    assert out.truncated
    assert out.text() == "01234\n[truncated 1 bytes]\n6789A"


def test_odd_cap_gives_the_extra_byte_to_the_tail() -> None:
    out = CappedOutput(5)
    out.feed(b"abcdefghij")

    assert out.text() == "ab\n[truncated 5 bytes]\nhij"


def test_invalid_utf8_is_replaced() -> None:
    out = CappedOutput(64)
    out.feed(b"ok \xff\xfe done")

    assert out.text() == "ok \ufffd\ufffd done"


def test_cap_below_two_is_rejected() -> None:
    with pytest.raises(ValueError):
        CappedOutput(1)


def test_memory_stays_bounded_by_the_cap_under_a_flood() -> None:
    chunk = b"y\n" * 32768  # 64 KiB, reused: only what CappedOutput keeps can grow
    out = CappedOutput(4096)
    tracemalloc.start()
    try:
        for _ in range(800):  # ~50 MiB
            out.feed(chunk)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert out.total == 800 * len(chunk)
    assert peak < 256 * 1024  # the tail slice of a chunk plus the kept bytes, never the stream


@given(
    data=st.binary(max_size=600),
    cap=st.integers(min_value=2, max_value=300),
    cuts=st.lists(st.integers(min_value=0, max_value=600), max_size=12),
)
def test_result_does_not_depend_on_how_the_stream_is_chunked(
    data: bytes, cap: int, cuts: list[int]
) -> None:
    out = CappedOutput(cap)
    bounds = [0, *sorted(c for c in cuts if c <= len(data)), len(data)]
    for start, end in itertools.pairwise(bounds):
        out.feed(data[start:end])

    assert out.total == len(data)
    assert out.truncated == (len(data) > cap)
    assert out.text() == expected_text(data, cap)
