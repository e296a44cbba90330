"""Token ids as OpenAI's logprobs show them: `bytes`, the bytes the token stands for in the output, and
`token`, those bytes as text, so that an output's tokens joined rebuild its text (and their bytes its UTF-8).

A vocabulary's symbols are not that text: byte-level BPE (GPT-2, Llama 3, Qwen) spells each byte as a
printable character (" with" is "Ġwith"), SentencePiece spells a space "▁" and a raw byte "<0xE2>". A
token that holds part of a multi-byte character has no text of its own: its `token` is the bytes escaped
("\\xe6\\x9d", as OpenAI writes them), and the bytes of consecutive tokens combine into the character.
Special tokens (`</s>`) are their own text.
"""
from __future__ import annotations

import json
import re

_SP_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's bytes -> printable characters map (tokenizers' ByteLevel), inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF = _byte_level_alphabet()


def _decoder_kind(tokenizer) -> str:
    """"byte_level", "sentencepiece" (▁ for a space, <0xNN> byte fallback) or "other", from a fast
    tokenizer's decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "other"
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
    if "ByteLevel" in kinds:
        return "byte_level"
    if "ByteFallback" in kinds or "Metaspace" in kinds or "Replace" in kinds:
        return "sentencepiece"
    return "other"


class TokenText:
    """One tokenizer's token id -> (text, bytes), computed once per id."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.kind = _decoder_kind(tokenizer)
        self._special = {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}
        self._bytes: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        token_id = int(token_id)
        found = self._bytes.get(token_id)
        if found is None:
            found = self._bytes[token_id] = self._compute(token_id)
        return found

    def text_of(self, token_id: int) -> str:
        return self.bytes_of(token_id).decode("utf-8", errors="backslashreplace")

    def _compute(self, token_id: int) -> bytes:
        symbol = self.tokenizer.convert_ids_to_tokens(token_id)
        if symbol is None:
            return b""
        if token_id in self._special:
            return symbol.encode()
        if self.kind == "byte_level" and all(c in _BYTE_OF for c in symbol):
            return bytes(_BYTE_OF[c] for c in symbol)
        if self.kind == "sentencepiece":
            byte = _SP_BYTE.fullmatch(symbol)
            return bytes([int(byte.group(1), 16)]) if byte else symbol.replace("\u2581", " ").encode()
        return self.tokenizer.convert_tokens_to_string([symbol]).encode()
