"""Grammar-forced drafts (SpecConfig.forced_drafts; structured/forced.py, engine/masking/grammar.py,
engine/speculative/drafter.py) on the zoo's trained target and heads, with real JSONSchemaBench dev schemas.

Forced drafts are drafts: greedy and seeded sampled guided outputs equal guided outputs without speculation for
every method (the draft heads get them through one-token draft masks and draft on after them; prompt lookup
and `grammar` get them as leading drafts on the host), every finished output is valid against its schema, and
they raise acceptance where the method alone cannot guess the grammar's text; unseeded sampling (rejection
sampling against forced drafts) keeps each position's distribution. Separately, how often a real
model's greedy tokens are the forced ones: the retokenization is exact against the tokenizer
(tests/structured/test_forced.py); models sometimes write another tokenization of the same text.
"""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams, SpecConfig, StructuredOutput
from tests.support.tiny import VOCAB

CASES = Path("/work/shared/data/jsonschemabench/cases")
MAX_TOKENS = 48


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread_module):
    """Tiny models: one intra-op thread (tests/engine/conftest.py)."""


@pytest.fixture(scope="module")
def schemas():
    """Six dev schemas (every 97th case in name order: all BFCL function-calling schemas, a tool-call workload)."""
    if not CASES.is_dir():
        pytest.skip(f"the JSONSchemaBench dev cases are not at {CASES}")
    return [json.loads(p.read_text())["schema"] for p in sorted(CASES.glob("*.json"))[::97][:6]]


def _llm(zoo_dir, spec: SpecConfig | None = None) -> LLM:
    llm = LLM(str(Path(zoo_dir) / "target"), num_kv_blocks=1024, block_size=16, speculative=spec)
    llm.engine.guided.compiler().compile_timeout_s = None  # a shared 2-core machine: no compile deadline
    return llm


def _params(schemas, sampled: bool, seeded: bool = True) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8 if sampled else 0,
                           seed=11 + i if sampled and seeded else None,
                           structured_output=StructuredOutput(json_schema=s)) for i, s in enumerate(schemas)]


def _prompts(schemas) -> list[str]:
    from zoo.prompts import json_schema_prompt

    return [json_schema_prompt(s) for s in schemas]


@pytest.fixture(scope="module")
def plain(zoo_dir, schemas):
    """sampled -> guided outputs without speculation."""
    llm = _llm(zoo_dir)
    return {sampled: llm.generate(_prompts(schemas), _params(schemas, sampled)) for sampled in (False, True)}


def _spec(zoo_dir, method: str, forced: bool, token_map: str | None = None) -> SpecConfig:
    draft = {"mtp": "mtp", "eagle3": "eagle3", "draft_model": "draft"}.get(method)
    return SpecConfig(method=method, k=3, draft=str(Path(zoo_dir) / draft) if draft else None, forced_drafts=forced,
                      token_map=token_map)


@pytest.mark.parametrize("method", ["mtp", "mtp-token-map", "eagle3", "draft_model", "ngram", "grammar"])
def test_forced_drafts_are_lossless_and_outputs_valid(zoo_dir, schemas, plain, method, tmp_path):
    """Greedy and seeded outputs equal; unseeded sampled ones (rejection sampling against the one-token draft
    distribution of a forced draft) finish valid. A head with a draft vocabulary (the zoo's EAGLE-3: 2,048 ids
    of its own; MTP under a token map) drafts forced tokens outside it too (the chain takes the grammar's token,
    q one-hot on it, where its masked logits admit nothing)."""
    token_map = None
    if method == "mtp-token-map":
        method, token_map = "mtp", tmp_path / "map.json"
        token_map.write_text(json.dumps(list(range(0, 4096, 2))))  # half the vocabulary: many forced tokens out
    llm = _llm(zoo_dir, _spec(zoo_dir, method, True, str(token_map) if token_map else None))
    for sampled in (False, True):
        outs = llm.generate(_prompts(schemas), _params(schemas, sampled))
        assert [o.token_ids for o in outs] == [r.token_ids for r in plain[sampled]], (method, sampled)
    for o, schema in zip(llm.generate(_prompts(schemas), _params(schemas, True, seeded=False)) + outs, schemas * 2):
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), schema)
    assert llm.engine.stats()["spec"]["mean_accepted_length"] > 1.5


@pytest.mark.parametrize("sampled", [False, True])
def test_forced_drafts_outside_the_draft_vocabulary_are_drafted(zoo_dir, schemas, plain, sampled, tmp_path):
    """MTP under a token map of ids the guided outputs never hold: the head alone cannot draft a single accepted
    token, so every accepted draft is one its grammar forced, from outside its vocabulary; outputs unchanged
    (greedy, and seeded sampling: q one-hot on the forced token, not the NaN of all-masked draft logits)."""
    emitted = {t for out in plain[False] + plain[True] for t in out.token_ids}
    token_map = tmp_path / "map.json"
    token_map.write_text(json.dumps([t for t in range(VOCAB) if t not in emitted][:256]))
    llm = _llm(zoo_dir, _spec(zoo_dir, "mtp", True, str(token_map)))
    outs = llm.generate(_prompts(schemas), _params(schemas, sampled))
    assert [o.token_ids for o in outs] == [r.token_ids for r in plain[sampled]]
    usage = [o.speculative for o in outs]
    assert sum(u.forced_tokens for u in usage) > 0
    assert 0 < sum(u.accepted_tokens for u in usage) <= sum(u.forced_tokens for u in usage), usage


def test_forced_drafts_raise_prompt_lookups_acceptance(zoo_dir, schemas, plain):
    """Prompt lookup alone finds a key only once it was written before; the grammar knows it at once."""
    means = {}
    for forced in (False, True):
        llm = _llm(zoo_dir, _spec(zoo_dir, "ngram", forced))
        outs = llm.generate(_prompts(schemas), _params(schemas, False))
        assert [o.token_ids for o in outs] == [r.token_ids for r in plain[False]]
        means[forced] = llm.engine.stats()["spec"]["mean_accepted_length"]
    assert means[True] >= means[False] + 0.3, means


def test_forced_drafts_off_draft_nothing_for_grammar_alone(zoo_dir, schemas, plain):
    llm = _llm(zoo_dir, _spec(zoo_dir, "grammar", False))
    outs = llm.generate(_prompts(schemas), _params(schemas, False))
    assert [o.token_ids for o in outs] == [r.token_ids for r in plain[False]]
    assert llm.engine.stats()["spec"]["mean_accepted_length"] == 1.0


def _agreement(llm: LLM, prompts, schemas) -> tuple[int, int]:
    """(positions where the forced run's first token is the greedy token, positions with a forced run)."""
    from structured.forced import ForcedTokenizer, forced_run

    outs = llm.generate(prompts, _params(schemas, False))
    compiler = llm.engine.guided.compiler()
    forced = ForcedTokenizer(llm.engine.tokenizer)
    scratch = compiler.allocate_bitmask(1)
    agree = total = 0
    for out, schema in zip(outs, schemas):
        structured = StructuredOutput(json_schema=schema)
        state = compiler.new_state(compiler.compile(structured), structured)
        ids = list(out.token_ids)
        for i, token in enumerate(ids):
            run = forced_run(state, forced, 1, tuple(ids[max(0, i - 4): i]), scratch)
            total += bool(run)
            agree += run == [token]
            assert state.accept(token)
    return agree, total


def test_greedy_writes_the_forced_tokens_nearly_always_zoo(zoo_dir, schemas):
    """Measured 0.97 on 30 dev schemas; the misses are the model writing `dat`, `e` for the canonical `date`."""
    agree, total = _agreement(_llm(zoo_dir), _prompts(schemas), schemas)
    assert total > 50 and agree / total >= 0.9, (agree, total)


@pytest.mark.slow
def test_greedy_writes_the_forced_tokens_nearly_always_smollm2(smollm2_dir, schemas):
    """Measured 0.92 on 16 dev schemas; SmolLM2 writes ` {`, `"` where its tokenizer writes ` {"`."""
    from transformers import AutoTokenizer

    from zoo.selfdistill import chat_ids, schema_prompt

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    llm = LLM(smollm2_dir, num_kv_blocks=1024, block_size=16)
    llm.engine.guided.compiler().compile_timeout_s = None
    agree, total = _agreement(llm, [chat_ids(tokenizer, schema_prompt(s)) for s in schemas[:4]], schemas[:4])
    assert total > 20 and agree / total >= 0.85, (agree, total)


# letters, then a forced `, the quick ` (the tiny tokenizer writes it `,`, ` the`, ` quick`, ` `), then letters:
# where the forced run starts depends on how many letters were sampled, so every position mixes sampled and
# forced tokens
FORCED_GUIDE = StructuredOutput(regex="[a-z]{1,3}, the quick [a-z ]{12,20}")
N = 1500


def _sample_forced_guide(llm: LLM) -> np.ndarray:
    from tests.support.distribution import PROMPT

    params = [SamplingParams(max_tokens=6, temperature=1.0, structured_output=FORCED_GUIDE) for _ in range(N)]
    outs = llm.generate([PROMPT] * N, params)
    tokens = np.array([o.token_ids for o in outs])
    assert tokens.shape == (N, 6)
    return tokens


def _same_distribution(a: np.ndarray, b: np.ndarray) -> float:
    """p-value of a two-sample chi-square (contingency) test; tokens seen fewer than 10 times pooled."""
    from scipy import stats

    ca, cb = np.bincount(a, minlength=VOCAB), np.bincount(b, minlength=VOCAB)
    big = (ca + cb) >= 10
    table = np.array([np.append(ca[big], ca[~big].sum()), np.append(cb[big], cb[~big].sum())])
    table = table[:, table.sum(0) > 0]
    return stats.chi2_contingency(table).pvalue if table.shape[1] > 1 else 1.0


@pytest.fixture(scope="module")
def forced_guide_plain(llama_dir):
    return _sample_forced_guide(LLM(llama_dir, num_kv_blocks=N * 6, block_size=4, max_num_seqs=512,
                                    max_num_batched_tokens=4096))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft_model", "ngram", "grammar"])
def test_unseeded_sampling_with_forced_drafts_keeps_the_distribution(llama_dir, near_draft, forced_guide_plain,
                                                                     method):
    """Rejection sampling (no seed) against forced drafts: a draft network's forced draft was drawn from a
    one-token draft mask (q is one-hot), prompt lookup's and `grammar`'s are deterministic; each emitted
    position's distribution equals the plain engine's (two-sample chi-square), and forced drafts ran."""
    spec = SpecConfig(method=method, k=3, draft=near_draft if method == "draft_model" else None)
    llm = LLM(llama_dir, num_kv_blocks=N * 6, block_size=4, max_num_seqs=512, max_num_batched_tokens=4096,
              speculative=spec)
    tokens = _sample_forced_guide(llm)
    for position in range(1, 6):
        assert _same_distribution(tokens[:, position], forced_guide_plain[:, position]) > 1e-3, position
    assert llm.engine.stats()["spec"]["mean_accepted_length"] > 1.3


def test_take_forced_makes_the_forced_token_the_draft_of_probability_one():
    """A forced row's draft is its forced token and q is one-hot on it, even where the masked draft logits admitted
    nothing (q NaN: a forced token outside a reduced draft vocabulary); other rows are untouched."""
    from engine.speculative.proposer import take_forced

    q = torch.tensor([[0.5, 0.5, 0.0, 0.0], [float("nan")] * 4, [0.1, 0.2, 0.3, 0.4]])
    token, q2 = take_forced(torch.tensor([-1, 3, 0]), torch.tensor([1, 0, 2]), q)
    assert token.tolist() == [1, 3, 0]
    assert torch.equal(q2, torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]]))
    token, none = take_forced(torch.tensor([-1, 2, -1]), torch.tensor([1, 0, 2]), None)  # greedy: no q
    assert token.tolist() == [1, 2, 2] and none is None
