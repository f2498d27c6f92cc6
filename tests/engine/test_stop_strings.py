"""StopStringMatcher: stops across deltas, minimal hold-back, earliest match, include flag."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from asyncengine.engine.stop_strings import StopStringMatcher


def run(stops, deltas, include=False):
    m = StopStringMatcher(stops, include)
    out, matched = [], None
    for d in deltas:
        text, matched = m.feed(d)
        out.append(text)
        if matched is not None:
            break
    else:
        out.append(m.flush())
    return out, matched


def test_stop_spanning_deltas_is_never_streamed():
    out, matched = run(["STOP"], ["Hello S", "T", "O", "P and more"])
    assert matched == "STOP"
    assert out == ["Hello ", "", "", ""]


def test_partial_prefix_released_when_it_stops_matching():
    m = StopStringMatcher(["STOP"])
    assert m.feed("Hello ST") == ("Hello ", None)
    assert m.held_back == "ST"
    assert m.feed("A") == ("STA", None)  # "STA" is no prefix of "STOP"
    assert m.held_back == ""
    assert m.feed("RS") == ("R", None)  # only the "S" might start a stop
    assert m.flush() == "S"
    assert m.flush() == ""


def test_minimal_hold_back_overlapping_prefix():
    m = StopStringMatcher(["abab"])
    assert m.feed("xaba") == ("x", None)  # "aba" is a prefix
    assert m.feed("c") == ("abac", None)
    m = StopStringMatcher(["aab"])
    assert m.feed("aaa") == ("a", None)  # hold only "aa"
    assert m.feed("b") == ("", "aab")


def test_include_stop_str_in_output():
    out, matched = run(["</end>"], ["result: 42</e", "nd> trailing"], include=True)
    assert matched == "</end>"
    assert "".join(out) == "result: 42</end>"
    # with include, nothing needs holding back: text is streamed at once
    m = StopStringMatcher(["</end>"], include_stop_str_in_output=True)
    assert m.feed("abc </e") == ("abc </e", None)
    assert m.feed("nd>xyz") == ("nd>", "</end>")


def test_multiple_stops_first_completed_wins():
    # "b" completes before "abc" could: it wins, even though "abc" would start earlier
    assert run(["abc", "b"], ["a", "b", "c"]) == (["", "a"], "b")
    assert run(["abc", "b"], ["abc"]) == (["a"], "b")
    # same end: the longer (earlier-starting) one
    assert run(["cd", "bcd"], ["abcde"]) == (["a"], "bcd")
    # independent of list order
    assert run(["xyz", "yz", "q"], ["aaxyzq"]) == (["aa"], "xyz")
    assert run(["q", "yz", "xyz"], ["aaxyzq"]) == (["aa"], "xyz")


def test_stop_at_very_start_and_after_match():
    m = StopStringMatcher(["\n\n"])
    assert m.feed("\n\nrest") == ("", "\n\n")
    assert m.stopped and m.matched == "\n\n"
    assert m.feed("more") == ("", None)


def test_no_stops_passthrough_and_empty_delta():
    m = StopStringMatcher(None)
    assert m.feed("anything") == ("anything", None)
    m = StopStringMatcher(["x"])
    assert m.feed("") == ("", None)


def test_unicode_stops():
    out, matched = run(["🛑", "終わり"], ["データ終", "わり です", "🛑"])
    assert matched == "終わり"
    assert "".join(out) == "データ"


# ---------------------------------------------------------------------------------------------

ALPHABET = "ab#c"


def first_stop(text: str, stops: list[str]):
    """Reference: the occurrence with the smallest end, then the smallest start."""
    best = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < (best[0] + len(best[1]), best[0])):
            best = (i, s)
    return best


def longest_held_suffix(text: str, stops: list[str]) -> int:
    for k in range(len(text), 0, -1):
        if any(s.startswith(text[-k:]) and len(s) > k for s in stops):
            return k
    return 0


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(ALPHABET, max_size=30),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
    include=st.booleans(),
)
def test_property_emitted_equals_truncated_text(text, stops, cuts, include):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    deltas = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    m = StopStringMatcher(stops, include)
    emitted, matched, seen = "", None, ""
    for d in deltas:
        piece, matched = m.feed(d)
        emitted += piece
        seen += d
        if matched is not None:
            break
        # not a byte more held back than needed, and nothing of a stop streamed
        if not include:
            assert emitted + m.held_back == seen
            assert len(m.held_back) == longest_held_suffix(seen, stops)
        else:
            assert emitted == seen
    if matched is None:
        emitted += m.flush()

    hit = first_stop(text, stops)
    if hit is None:
        assert matched is None
        assert emitted == text
    else:
        i, s = hit
        assert matched == s
        assert emitted == (text[:i + len(s)] if include else text[:i])
