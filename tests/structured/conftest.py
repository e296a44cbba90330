"""The grammar tests' tokenizer and compiler, on the tiny test vocabulary (tests/support/tiny.py)."""
import pytest

from tests.support.tiny import VOCAB, tiny_tokenizer


@pytest.fixture(scope="session")
def grammar_tokenizer(tmp_path_factory):
    """The tiny tokenizer (VOCAB ids) for grammar tests; id 1 ends a guided output."""
    return tiny_tokenizer(tmp_path_factory.mktemp("grammar_tok"))


@pytest.fixture(scope="session")
def grammar_compiler(grammar_tokenizer):
    from structured.compiler import GrammarCompiler

    return GrammarCompiler(grammar_tokenizer, VOCAB, [1])
