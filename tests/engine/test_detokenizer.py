"""Incremental detokenization (engine and router share it): same text as decoding everything at once, split characters
wait, stop strings cut the text and held-back tails never leak."""
from __future__ import annotations

import pytest

from engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_dir)


TEXTS = ["The quick brown fox jumps over the lazy dog.", "Grüße aus Köln, naïve café, 東京 and more",
         "def add(a, b):\n    return a + b\n"]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_one_shot_decode(tokenizer, text):
    prompt = tokenizer.encode("Hello, how are you?")
    out = tokenizer.encode(text)
    det = IncrementalDetokenizer(tokenizer, prompt)
    shown = "".join(det.push([t]).text for t in out) + det.flush().text
    assert shown == tokenizer.decode(out) == text


def test_bytes_of_one_character_split_across_tokens_wait(tokenizer):
    out = tokenizer.encode("東")
    assert len(out) > 1  # byte-level BPE: the character spans several tokens here
    det = IncrementalDetokenizer(tokenizer, [5])
    partial = [det.push([t]).text for t in out[:-1]]
    assert all(p == "" for p in partial)
    assert det.push(out[-1:]).text == "東"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_ends_the_text_and_nothing_held_back_leaks(tokenizer, include):
    out = tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    det = IncrementalDetokenizer(tokenizer, [5], stop=["fox j", "zzz"], include_stop=include)
    shown = ""
    for t in out:
        d = det.push([t])
        shown += d.text
        assert "fox" not in shown or include  # the held-back tail never shows a partial stop string
        if d.stop:
            break
    assert d.stop == "fox j"
    assert shown == ("The quick brown fox j" if include else "The quick brown ")
    assert det.push(tokenizer.encode(" more")).text == ""


def test_flush_releases_a_held_back_tail_that_never_became_a_stop(tokenizer):
    out = tokenizer.encode("The quick brown fox")
    det = IncrementalDetokenizer(tokenizer, [5], stop=["fox jumps"])
    shown = "".join(det.push([t]).text for t in out)
    assert shown != "The quick brown fox"  # "fox" could still start "fox jumps": held back
    assert shown + det.flush().text == "The quick brown fox"
