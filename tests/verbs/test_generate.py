"""generate's text stream: written as tokens come, never taking back what it wrote, ending as the final text."""

from __future__ import annotations

from draftport.verbs.generate import TextStream, cut_at_stops

PIECES = {1: "Hello", 2: ",", 3: " world", 4: "\n", 5: "\nUs", 6: "er:", 7: " more", 8: "\xe2", 9: "\x82\xac"}


def _decode(ids):
    """Token pieces as bytes decoded together, as a byte-level tokenizer does (8 then 9 is one character, €)."""
    return "".join(PIECES[i] for i in ids).encode("latin-1").decode("utf-8", errors="replace")


def _stream(chunks, stops=("\nUser:",)):
    written = []
    s = TextStream(_decode, stops, written.append)
    for c in chunks:
        s(c)
    final = cut_at_stops(_decode([t for c in chunks for t in c]), stops)
    shown_before_finish = "".join(written)
    s.finish(final)
    return written, shown_before_finish, final


def test_text_comes_as_tokens_come_and_ends_as_the_final_text():
    written, before, final = _stream([[1], [2, 3], [7]])
    assert written[:3] == ["Hello", ", world", " more"] and "".join(written) == final + "\n"
    assert before == "Hello, world more"


def test_a_stop_string_and_trailing_newlines_are_held_back_and_cut():
    # "\nUs" may begin "\nUser:": held back; "er:" completes it, so the stream ends before it
    written, before, final = _stream([[1], [4], [5], [6], [7]])
    assert final == "Hello\n" and before == "Hello" and "".join(written) == "Hello\n"
    # a newline that turns out to be text is written once more text follows it
    written, _, final = _stream([[1], [4], [3]])
    assert written == ["Hello", "\n world", "\n"] and final == "Hello\n world"


def test_an_incomplete_character_waits_for_its_next_byte():
    written, _, final = _stream([[1], [8], [9], [3]])
    assert written == ["Hello", "€", " world", "\n"] and final == "Hello€ world"  # nothing written for byte 8 alone
