"""Stop sequences on streamed text (`serving.stop.StopMatcher`): whatever the cut of the text into
pieces, the pieces emitted concatenate to the text before the first stop string, and no emitted
piece holds a character of a stop string that then completes."""

import pytest

from serving.stop import StopMatcher


def run(stops, pieces):
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        text, stopped = m.feed(p)
        out.append(text)
        if stopped:
            return out, True
    out.append(m.flush())
    return out, False


def cuts(text, rng, n):
    """n random ways of cutting text into pieces (empty pieces too: a token of no text)."""
    for _ in range(n):
        idx = sorted(rng.integers(0, len(text) + 1, rng.integers(0, len(text) + 2)).tolist())
        yield [text[a:b] for a, b in zip([0] + idx, idx + [len(text)])]


@pytest.mark.parametrize(
    "text, stops, want, stopped",
    [
        ("hello world. bye", ["."], "hello world", True),
        ("hello world. bye", ["world", "."], "hello ", True),  # the earliest stop in the text wins
        ("hello world. bye", ["wor", "world"], "hello ", True),
        ("aaab", ["aab"], "a", True),  # a partial match that fails, then one that starts inside it
        ("abcabd", ["abd"], "abc", True),
        ("no stop here", ["stop!", "zz"], "no stop here", False),  # a held-back "stop" is released at the end
        ("ends in a prefix st", ["stop"], "ends in a prefix st", False),
        ("\ufffd\ufffdx", ["\ufffdx"], "\ufffd", True),
        ("plain", [], "plain", False),
    ],
)
def test_pieces_concatenate_to_the_text_cut_before_the_first_stop(rng, text, stops, want, stopped):
    for pieces in cuts(text, rng, 50):
        out, got_stopped = run(stops, pieces)
        assert "".join(out) == want and got_stopped == stopped, pieces


def test_no_emitted_piece_carries_a_character_of_the_stop_string(rng):
    text, stop = "the answer is 42 END and more", "END"
    for pieces in cuts(text, rng, 50):
        out, stopped = run([stop], pieces)
        assert stopped and "".join(out) == "the answer is 42 "
        assert not any("E" in p or "N" in p or "D" in p for p in out)


def test_after_a_stop_nothing_more_comes_out_and_empty_stops_are_refused():
    m = StopMatcher(["x"])
    assert m.feed("ax") == ("a", True) and m.feed("more") == ("", True) and m.flush() == ""
    with pytest.raises(ValueError, match="non-empty"):
        StopMatcher([""])
