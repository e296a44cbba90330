"""Grammars read by their syntax (issue 32): GBNF (`name ::= ...`) compiled by xgrammar, Lark (`name: ...`)
by llguidance, through GrammarCompiler with the tiny tokenizer: random walks under the mask write only
what the grammar allows, the hand-over's serialized form loads, and a Lark grammar that does not compile
is a 400."""
from __future__ import annotations

import re

import pytest

from engine.errors import InvalidRequestError
from structured import llguidance as llg
from structured.compiler import GrammarCompiler
from structured.request import StructuredOutput
from tests.support.grammar import walk_tokens
from tests.support.tiny import VOCAB, tiny_tokenizer

pytestmark = pytest.mark.skipif(not llg.available(), reason="llguidance is not installed")
EOS = 1
LARK = 'start: pet " " count\npet: "cat" | "dog"\ncount: /[0-9]{1,2}/\n'
GBNF = 'root ::= ("cat" | "dog") " " [0-9] [0-9]?'


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB, [EOS])


def test_the_syntax_picks_the_backend():
    assert StructuredOutput(grammar=LARK).plan.backend == "llguidance"
    assert StructuredOutput(grammar=GBNF).plan.backend == "xgrammar"
    assert StructuredOutput(grammar=LARK).key() != StructuredOutput(grammar=GBNF).key()


@pytest.mark.parametrize("grammar", [LARK, GBNF])
def test_walks_under_either_grammar_write_only_what_it_allows(compiler, tokenizer, grammar):
    spec = StructuredOutput(grammar=grammar)
    for seed in range(6):
        out, last = walk_tokens(compiler, spec, seed, max_steps=40)
        assert last == EOS and re.fullmatch(r"(cat|dog) [0-9]{1,2}", tokenizer.decode(out)), tokenizer.decode(out)


def test_a_lark_grammar_survives_the_hand_over(compiler, tokenizer):
    spec = StructuredOutput(grammar=LARK)
    serialized = compiler.serialize(compiler.compile(spec))
    assert serialized.backend == "llguidance"
    other = GrammarCompiler(tokenizer, VOCAB, [EOS])
    state = other.new_state(other.deserialize(serialized), spec)
    for token in tokenizer.encode("dog 7", add_special_tokens=False):
        assert state.accept(token)


def test_a_lark_grammar_that_does_not_compile_is_refused(compiler):
    with pytest.raises(InvalidRequestError) as e:
        compiler.compile(StructuredOutput(grammar="start: missing_rule\n"))
    assert "Lark" in e.value.message
