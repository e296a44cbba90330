"""The tiny test vocabulary: a byte-level BPE tokenizer trained in the test session (deterministic)."""
from __future__ import annotations

VOCAB = 384


def tiny_tokenizer(path):
    """The tiny byte-level BPE tokenizer (VOCAB ids) saved in `path`, returned loaded."""
    from engine.testing import save_tiny_tokenizer

    text = ["The quick brown fox jumps over the lazy dog. {\"name\": \"Ada\", \"age\": 36}",
            "def add(a, b):\n    return a + b\n", "Grüße aus Köln, naïve café, 東京"] * 20
    return save_tiny_tokenizer(path, VOCAB, text)
