"""Streamed text is released only where it is final: never a partial stop string, never half a character."""

from __future__ import annotations

from transformers import AutoTokenizer

from localtinker.engine.models import tiny_random_dir
from localtinker.protocol.openai_api import StreamedText


def _stream(text: str, stop: tuple[str, ...]) -> tuple[list[str], StreamedText]:
    tokenizer = AutoTokenizer.from_pretrained(tiny_random_dir())
    tokens = tokenizer.encode(text)
    streamed = StreamedText(tokenizer, stop)
    return [streamed.update(tokens[:end]) for end in range(1, len(tokens) + 1)], streamed


def test_a_tail_that_may_become_a_stop_string_waits_and_the_stop_string_is_never_sent() -> None:
    deltas, streamed = _stream("The answer is 42.\n\nUser: thanks", ("\n\nUser:",))
    assert "".join(deltas) == "The answer is 42."
    assert all("\n" not in delta for delta in deltas) and streamed.stopped
    assert streamed.finish("The answer is 42.") == ""


def test_a_partial_utf8_character_waits_for_its_other_bytes() -> None:
    deltas, streamed = _stream("café 🙂 ok", ())
    assert "".join(deltas) == "café 🙂 ok" and not any("\ufffd" in delta for delta in deltas)
    assert streamed.finish("café 🙂 ok!") == "!"
