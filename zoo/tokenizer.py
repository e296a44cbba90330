"""The zoo's byte-level BPE tokenizer, trained with HF `tokenizers`, saved for transformers.

Byte-level, so every string (any script, any emoji) round-trips exactly. The special tokens of
`zoo.prompts` come first (ids 0..5) and are never split. No bos is added implicitly: the chat
template writes `<|bos|>` itself and the corpus prepends it to raw documents, so prompt and training
text tokenize the same way.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from zoo.prompts import BOS, CHAT_TEMPLATE, END, PAD, SPECIAL_TOKENS

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train byte-level BPE on `texts`; deterministic for the same texts and vocab size."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Write the PreTrainedTokenizerFast files (tokenizer.json, tokenizer_config.json, special map)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    added = {
        str(tokenizer.token_to_id(tok)): {
            "content": tok, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for tok in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": END,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (BOS, END, PAD)],
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    special = {"bos_token": BOS, "eos_token": END, "pad_token": PAD,
               "additional_special_tokens": config["additional_special_tokens"]}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def load_tokenizer(tokenizer_dir: Path) -> Tokenizer:
    """The raw `tokenizers` object (fast batch encoding in the build; no transformers import)."""
    return Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
