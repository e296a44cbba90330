"""The grammar compiles while the prompt runs (issue 11): LLMEngine.add_request starts the compile, the
scheduler runs every prompt chunk but the one that samples, and that chunk waits for the grammar.
The compile is made slow here by a gate the test opens, so the order of events is exact, not timed."""
from __future__ import annotations

import threading

import pytest

from engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams, StructuredOutput
from structured.compiler import GrammarCompiler

SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", "bird"]}, "ok": {"type": "boolean"}},
          "required": ["kind", "ok"], "additionalProperties": False}
PROMPT = [(7 * i + 3) % 300 + 5 for i in range(37)]  # 37 tokens: five chunks of 8, the last one short


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread_module):
    """Tiny models: one intra-op thread (tests/engine/conftest.py)."""


@pytest.fixture
def gate(monkeypatch):
    """Compiles block until the test sets the returned event."""
    opened = threading.Event()
    compile_ = GrammarCompiler._compile

    def gated(self, structured):
        opened.wait(30)
        return compile_(self, structured)

    monkeypatch.setattr(GrammarCompiler, "_compile", gated)
    return opened


def _engine(llama_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=64, block_size=4, max_num_batched_tokens=8))


def _params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=24, temperature=0.8, seed=11, **kw)


def _run(engine: LLMEngine) -> dict:
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return done


def test_prompt_runs_while_the_grammar_compiles_and_tokens_are_unchanged(llama_dir, gate):
    reference = _engine(llama_dir)
    gate.set()
    reference.add_request("g", PROMPT, _params(structured_output=StructuredOutput(json_schema=SCHEMA)))
    expected = _run(reference)["g"]
    gate.clear()

    engine = _engine(llama_dir)
    engine.add_request("g", PROMPT, _params(structured_output=StructuredOutput(json_schema=SCHEMA)))
    engine.add_request("plain", PROMPT[:5], _params())  # behind it in the queue, not held up by it
    req = engine.requests["g"]
    outputs = []
    for _ in range(8):  # far more steps than the prompt needs
        outputs += engine.step()
    assert req.num_computed_tokens == len(PROMPT) - 1  # all of the prompt but the chunk that samples
    assert not req.output_token_ids and not req.grammar_ready
    assert any(o.request_id == "plain" and o.token_ids for o in outputs)  # the unguided request went on
    gate.set()
    done = _run(engine)
    assert done["g"].token_ids == expected.token_ids and done["g"].finish_reason == "stop"
    assert engine.stats()["kv_blocks_used"] == 0


def test_a_compile_that_fails_after_the_prompt_ran_frees_everything(llama_dir, gate):
    engine = _engine(llama_dir)
    engine.add_request("bad", PROMPT, _params(structured_output=StructuredOutput(regex="(unclosed")))
    for _ in range(6):
        engine.step()
    assert engine.requests["bad"].num_computed_tokens == len(PROMPT) - 1
    assert engine.stats()["kv_blocks_used"] > 0
    gate.set()
    done = _run(engine)
    bad = done["bad"]
    assert bad.finish_reason == "error" and not bad.token_ids
    assert isinstance(bad.error, InvalidRequestError) and bad.error.param == "response_format"
    assert engine.stats()["kv_blocks_used"] == 0 and not engine.guided.grammar.states and not engine.guided.compiling


def test_abort_while_compiling(llama_dir, gate):
    engine = _engine(llama_dir)
    engine.add_request("r", PROMPT, _params(structured_output=StructuredOutput(json_schema=SCHEMA)))
    engine.step()
    engine.abort("r")
    done = _run(engine)
    gate.set()
    assert done["r"].finish_reason == "abort" and engine.stats()["kv_blocks_used"] == 0
    assert not engine.guided.compiling


def test_without_chunked_prefill_the_request_waits_whole(llama_dir, gate):
    engine = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=64, block_size=4, enable_chunked_prefill=False))
    engine.add_request("g", PROMPT, _params(structured_output=StructuredOutput(json_schema=SCHEMA)))
    engine.step()
    assert engine.requests["g"].num_computed_tokens == 0
    gate.set()
    assert _run(engine)["g"].finish_reason in ("stop", "length")


def test_a_refused_schema_is_still_an_error_at_once(llama_dir):
    """Where only xgrammar could serve it (non-compact JSON: llguidance is set up for compact JSON), a
    keyword xgrammar cannot enforce is refused by add_request before anything compiles."""
    engine = _engine(llama_dir)
    with pytest.raises(InvalidRequestError, match="'not'"):
        engine.add_request("r", PROMPT, _params(structured_output=StructuredOutput(
            json_schema={"type": "object", "not": {"required": ["a"]}}, compact=False)))
    assert "r" not in engine.requests and not engine.guided.compiling
