"""Helpers for tests and demos that need a real (tiny) tokenizer without any download."""
from __future__ import annotations


def save_tiny_tokenizer(path, vocab: int, texts: list[str], chat_template: str | None = None):
    """Train a byte-level BPE tokenizer (<s>, </s>, <pad> = ids 0, 1, 2) on `texts`, save it as a
    transformers tokenizer in `path` and return it. Deterministic for the same texts and vocab."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(path)
    return fast
