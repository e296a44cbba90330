"""router/token_text.py and the logprobs bodies of router/responses.py without a server: token text and bytes
for byte-level BPE and SentencePiece vocabularies (real `tokenizers` tokenizers trained here), and the
completions and chat logprobs shapes."""
from __future__ import annotations

import pytest

from router.responses import LogprobsBuilder
from router.token_text import TokenText

TEXTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n",
         "Grüße aus Köln, naïve café, 東京 ☃", "Hello, how are you?"] * 10
SAMPLES = ["Hello with naïve café", "  spaced\n\tout", "東京 and ☃!", "a"]


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    from engine.testing import save_tiny_tokenizer

    return save_tiny_tokenizer(tmp_path_factory.mktemp("bl"), 300, TEXTS)


@pytest.fixture(scope="module")
def sentencepiece():
    """A Llama-style vocabulary: "▁" for a space, <0xNN> byte fallback for what it does not cover."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    pieces = ["<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "\u2581", *"abcdefghijklmnopqrstuvwxyzH!",
              "\u2581w", "\u2581wi", "\u2581wit", "\u2581with", "He", "Hel", "Hell", "Hello"]
    merges = [("\u2581", "w"), ("\u2581w", "i"), ("\u2581wi", "t"), ("\u2581wit", "h"), ("H", "e"), ("He", "l"),
              ("Hel", "l"), ("Hell", "o")]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, merges, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(["<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("vocab,kind", [("byte_level", "byte_level"), ("sentencepiece", "sentencepiece")])
def test_token_bytes_join_to_the_text_and_token_text_is_not_vocabulary_symbols(request, vocab, kind):
    """Pins issue 32 (2): logprob tokens were byte-level BPE symbols ("Ġwith" for " with"), and bytes those
    symbols' UTF-8, so joined tokens never rebuilt the text."""
    tokenizer = request.getfixturevalue(vocab)
    text = TokenText(tokenizer)
    assert text.kind == kind
    for sample in SAMPLES:
        ids = tokenizer.encode(sample, add_special_tokens=False)
        assert b"".join(text.bytes_of(i) for i in ids).decode() == tokenizer.decode(ids) == sample
        for i in ids:  # a token's text is its bytes, escaped where they are part of a character
            assert text.text_of(i) == text.bytes_of(i).decode("utf-8", errors="backslashreplace")
            assert "\u0120" not in text.text_of(i) and "\u2581" not in text.text_of(i)
        if sample.isascii():
            assert "".join(text.text_of(i) for i in ids) == sample


def test_a_piece_of_a_character_is_escaped_as_openai_does(byte_level):
    text = TokenText(byte_level)
    ids = byte_level.encode("☃", add_special_tokens=False)  # three bytes, not merged in this small vocabulary
    assert [text.text_of(i) for i in ids] == ["\\xe2", "\\x98", "\\x83"]
    assert [list(text.bytes_of(i)) for i in ids] == [[0xE2], [0x98], [0x83]]


def test_special_tokens_are_their_own_text(byte_level):
    eos = byte_level.convert_tokens_to_ids("</s>")
    assert TokenText(byte_level).text_of(eos) == "</s>"


def test_completions_logprobs_list_the_sampled_token_and_offsets(byte_level):
    """Pins issue 32 (3): text_offset was always [] and logprobs=0 gave top_logprobs [null, ...]."""
    text = TokenText(byte_level)
    ids = byte_level.encode("Hello with", add_special_tokens=False)
    lp = LogprobsBuilder(text, chat=False)
    offsets = [0]
    for i in ids[:-1]:
        offsets.append(offsets[-1] + len(text.text_of(i)))
    lp.add([(i, -0.5, None) for i in ids[:1]], offsets[:1])
    lp.add([(i, -1.0, {i: -1.0, 7: -0.25}) for i in ids[1:]], offsets[1:])
    body = lp.body()
    assert "".join(body["tokens"]) == "Hello with" and body["text_offset"] == offsets
    assert body["top_logprobs"][0] == {text.text_of(ids[0]): -0.5}  # logprobs=0: the sampled token alone
    assert list(body["top_logprobs"][1].values()) == [-0.25, -1.0]  # most likely first
    assert body["token_logprobs"] == [-0.5] + [-1.0] * (len(ids) - 1)


def test_chat_logprobs_carry_text_and_bytes(byte_level):
    text = TokenText(byte_level)
    ids = byte_level.encode("naïve", add_special_tokens=False)
    lp = LogprobsBuilder(text, chat=True)
    chunk = lp.add([(i, -1.0, {i: -1.0}) for i in ids], [0] * len(ids))
    content = chunk["content"]
    assert bytes(b for entry in content for b in entry["bytes"]).decode() == "naïve"
    assert all(entry["top_logprobs"][0]["bytes"] == entry["bytes"] for entry in content)
