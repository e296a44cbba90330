"""structured/forced.py: the tokens a grammar forces, retokenized canonically and cut before what could merge.

The exact check is against the tokenizer, on real schemas (JSONSchemaBench dev cases) and both real
vocabularies (the zoo's and SmolLM2's): for every valid instance the grammar accepts, written as the
compact grammar writes JSON and tokenized canonically, the forced run at EVERY position is exactly the
next tokens of that canonical tokenization. A model that writes its tokenizer's tokenization (greedy
decoding under the mask, whenever it is canonical) therefore writes the forced tokens; where a model
writes another tokenization of the same text the drafts are merely rejected
(tests/engine/speculative/test_forced_drafts.py measures how often that happens).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from structured.compiler import GrammarCompiler
from structured.forced import ForcedTokenizer, forced_run, single_token
from structured.request import StructuredOutput

CASES = Path("/work/shared/data/jsonschemabench/cases")
EVERY = 97  # every 97th dev case in name order: 81 schemas spread over every subset


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def zoo_tokenizer(zoo_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(Path(zoo_dir) / "target"))


def _compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer), compile_timeout_s=None)


def _dev_instances(compiler: GrammarCompiler, tokenizer):
    """(case name, compiled grammar, structured, canonical token ids + EOS) of the first valid instance of every
    EVERY-th dev case, where the grammar accepts it."""
    if not CASES.is_dir():
        pytest.skip(f"the JSONSchemaBench dev cases are not at {CASES}")
    eos = tokenizer.eos_token_id
    out = []
    for path in sorted(CASES.glob("*.json"))[::EVERY]:
        case = json.loads(path.read_text())
        structured = StructuredOutput(json_schema=case["schema"])
        try:
            grammar = compiler.compile(structured)
        except Exception:  # noqa: BLE001 - refused or uncompilable schemas are not this test's subject
            continue
        for test in case["tests"]:
            if not test["valid"]:
                continue
            text = json.dumps(test["data"], separators=(", ", ": "), ensure_ascii=False)
            ids = tokenizer.encode(text, add_special_tokens=False) + [eos]
            state = compiler.new_state(grammar, structured)
            if all(state.accept(t) for t in ids) and state.terminated:  # key order or formatting the grammar writes
                out.append((path.name, grammar, structured, ids))
            break
    return out


def _check_runs_follow_the_canonical_tokenization(tokenizer) -> int:
    compiler = _compiler(tokenizer)
    forced = ForcedTokenizer(tokenizer)
    cases = _dev_instances(compiler, tokenizer)
    assert len(cases) >= 30, f"only {len(cases)} dev instances accepted by their grammar"
    assert len({name.split("_")[0].split("-")[0] for name, *_ in cases}) >= 5, "too few subsets"
    scratch = compiler.allocate_bitmask(1)
    covered = 0  # positions with a forced run
    for name, grammar, structured, ids in cases:
        state = compiler.new_state(grammar, structured)
        for i in range(len(ids)):
            run = forced_run(state, forced, 8, tuple(ids[max(0, i - 4): i]), scratch)
            assert run == ids[i: i + len(run)], (name, i, tokenizer.convert_ids_to_tokens(run),
                                                 tokenizer.convert_ids_to_tokens(ids[i: i + len(run)]))
            covered += bool(run)
            assert state.accept(ids[i])
    positions = sum(len(ids) for *_, ids in cases)
    assert covered >= 0.2 * positions, (covered, positions)  # keys, separators, brackets: a real share of JSON
    return covered


def test_forced_runs_are_the_zoo_tokenizers_canonical_tokens(zoo_tokenizer):
    _check_runs_follow_the_canonical_tokenization(zoo_tokenizer)


@pytest.mark.slow
def test_forced_runs_are_smollm2s_canonical_tokens(smollm2_tokenizer):
    _check_runs_follow_the_canonical_tokenization(smollm2_tokenizer)


def test_the_run_stops_before_the_strings_last_word(smollm2_tokenizer):
    """`"name": "` is forced after `{`, but its last word ` "` merges with what the model writes next
    (` "` + `,` is one token, `",`): the run ends before it."""
    forced = ForcedTokenizer(smollm2_tokenizer)
    assert smollm2_tokenizer.convert_ids_to_tokens(list(forced.tokens('{"name": "'))) == ['{"', 'name', '":']
    # after an emitted `{"setLa`, `uncherInfo": ` continues a word: its tokens are the whole word's
    context = tuple(smollm2_tokenizer.encode('{"setLa', add_special_tokens=False))
    whole = smollm2_tokenizer.encode('{"setLauncherInfo": 1', add_special_tokens=False)
    run = forced.tokens('uncherInfo": ', context)
    assert list(context) + list(run) == whole[: len(context) + len(run)] and len(run) == 4
    assert forced.tokens("") == () and forced.tokens(" ") == ()


def test_forced_run_leaves_the_state_and_respects_limit_and_grammar(smollm2_tokenizer):
    compiler = _compiler(smollm2_tokenizer)
    schema = {"type": "object", "properties": {"kind": {"enum": ["alpha-centauri"]}, "n": {"type": "integer"}},
              "required": ["kind", "n"]}
    structured = StructuredOutput(json_schema=schema)
    state = compiler.new_state(compiler.compile(structured), structured)
    forced = ForcedTokenizer(smollm2_tokenizer)
    scratch = compiler.allocate_bitmask(1)
    full = forced_run(state, forced, 64, (), scratch)
    text = smollm2_tokenizer.decode(full)
    assert text == '{"kind": "alpha-centauri", "n":', text  # the enum is forced too; the integer is not
    assert forced_run(state, forced, 3, (), scratch) == full[:3]
    assert forced_run(state, forced, 0, (), scratch) == []
    assert all(state.accept(t) for t in full)  # the state was left at the start: the run is accepted from there
    assert forced_run(state, forced, 8, (), scratch) == []


def test_single_token():
    bits = torch.zeros((1, 4), dtype=torch.int32)

    class Fixed:
        def __init__(self, row):
            self.row = row

        def fill_bitmask(self, bitmask, row):
            bitmask[row] = self.row

    for token in (0, 31, 32, 127):
        row = torch.zeros(4, dtype=torch.int32)
        row[token // 32] = torch.tensor(1 << (token % 32), dtype=torch.int64).to(torch.int32)
        assert single_token(Fixed(row), bits) == token
    assert single_token(Fixed(torch.tensor([3, 0, 0, 0], dtype=torch.int32)), bits) is None
    assert single_token(Fixed(torch.tensor([1, 0, 1, 0], dtype=torch.int32)), bits) is None
    assert single_token(Fixed(torch.zeros(4, dtype=torch.int32)), bits) is None


def test_llguidance_states_force_the_same_text(smollm2_tokenizer):
    """A schema only llguidance enforces (multipleOf): its forced bytes give the same run as xgrammar's would."""
    from structured import llguidance as llg

    if not llg.available():
        pytest.skip("llguidance is not installed")
    compiler = _compiler(smollm2_tokenizer)
    schema = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                               "w": {"type": "number", "multipleOf": 0.5}},
              "required": ["kind", "w"], "additionalProperties": False}
    structured = StructuredOutput(json_schema=schema)
    state = compiler.new_state(compiler.compile(structured), structured)
    assert isinstance(state, llg.LLGuidanceState)
    forced = ForcedTokenizer(smollm2_tokenizer)
    run = forced_run(state, forced, 16, (), compiler.allocate_bitmask(1))
    # the string's last word ` "` is cut, then forced anyway: the mask admits no other token there
    assert smollm2_tokenizer.decode(run) == '{"kind": "'
    for t in smollm2_tokenizer.encode('{"kind": "cat", "w": ', add_special_tokens=False):
        assert state.accept(t)
    assert state.jump_forward_string() == ""  # a number: nothing forced
