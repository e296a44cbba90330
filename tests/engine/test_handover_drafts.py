"""A hand-over's first drafts (engine/handover.py HandoverDrafts): the prefill engine drafts for a prefill-only
request in the step that samples its first token, and the decode engine's first step verifies those drafts like
any other request's. Two engines in one process, the KV copied between their caches as the prefill worker's
payload would carry it."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jsonschema
import pytest

from engine import LLM, EngineConfig, LLMEngine, SamplingParams, SpecConfig, StructuredOutput
from tests.support.spec import greedy_params, random_prompts


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread_module):
    pass


def engines(llama_dir: str, spec: SpecConfig) -> tuple[LLMEngine, LLMEngine]:
    cfg = EngineConfig(model=llama_dir, num_kv_blocks=64, block_size=4, speculative=spec)
    return LLMEngine(cfg), LLMEngine(cfg)


def hand_over(prefill: LLMEngine, decode: LLMEngine, rid: str, prompt: list[int], params: SamplingParams,
              keep=lambda drafts: drafts):
    """Prefill `rid` on `prefill`, hand it to `decode` with keep(its drafts); -> (the hand-over, its outputs)."""
    prefill.add_request(rid, prompt, params, prefill_only=True)
    while prefill.requests[rid].status.value != "parked":
        prefill.step()
    h = prefill.take_handover(rid)
    blocks = decode.reserve(h.request)
    decode.kv_cache[:, :, blocks] = prefill.kv_cache[:, :, h.block_ids]
    prefill.release(rid)
    decode.commit(rid, drafts=keep(h.drafts))
    return h


def decode_all(decode: LLMEngine, rid: str) -> tuple[list[int], int]:
    """-> (the request's tokens, drafts its first decode step verified)."""
    outs = decode.step()
    first = decode.requests[rid].metrics.num_draft_tokens
    while decode.has_unfinished():
        outs += decode.step()
    return [o for o in outs if o.request_id == rid][-1].token_ids, first


def single_engine(llama_dir: str, spec: SpecConfig, prompt: list[int], params: SamplingParams) -> list[int]:
    eng = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=64, block_size=4, speculative=spec))
    eng.add_request("x", prompt, params)
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    return outs[-1].token_ids


def test_a_tree_travels_with_its_shape(llama_dir, spec_drafts):
    """A draft tree's nodes and shape (parents, depth, ancestors) cross with the hand-over; the decode side's first
    step verifies every node and the tokens are those of no speculation."""
    spec = SpecConfig(method="mtp", k=3, draft=spec_drafts["mtp"], topk=2, num_verify_tokens=5)
    prefill, decode = engines(llama_dir, spec)
    prompt = random_prompts(1)[0]
    h = hand_over(prefill, decode, "r", prompt, greedy_params())
    assert len(h.drafts.token_ids) == 5 and len(h.drafts.tree[0]) == 5 and h.drafts.probs is None
    tokens, first = decode_all(decode, "r")
    assert first == 5  # every node the prefill drafted (not cut to the tree's depth, k = 3)
    assert tokens == single_engine(llama_dir, None, prompt, greedy_params())


@pytest.mark.parametrize("seed", [None, 7])
def test_sampled_drafts_travel_with_their_distributions(llama_dir, spec_drafts, seed):
    """A sampled request's chain crosses with its draft distributions (what rejection sampling reads); a seeded
    one's tokens are the single engine's (sampling keyed by seed and position, any schedule)."""
    spec = SpecConfig(method="mtp", k=3, draft=spec_drafts["mtp"])
    prefill, decode = engines(llama_dir, spec)
    prompt = random_prompts(1)[0]
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=seed, ignore_eos=True)
    h = hand_over(prefill, decode, "r", prompt, params)
    assert h.drafts.probs.shape == (3, decode.model_cfg.vocab_size)
    slot = decode.drafter.slot("r")
    assert decode.drafter.draft_probs[slot, :3].equal(h.drafts.probs)
    tokens, first = decode_all(decode, "r")
    assert first == 3 and len(tokens) == 16
    if seed is not None:
        assert tokens == single_engine(llama_dir, spec, prompt, params)


def test_sampled_drafts_without_distributions_are_dropped(llama_dir, spec_drafts):
    """Drafts whose distributions did not come cannot be verified losslessly: the request starts without them."""
    spec = SpecConfig(method="mtp", k=3, draft=spec_drafts["mtp"])
    prefill, decode = engines(llama_dir, spec)
    prompt = random_prompts(1)[0]
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True)
    hand_over(prefill, decode, "r", prompt, params, keep=lambda d: dataclasses.replace(d, probs=None))
    assert decode.requests["r"].spec_token_ids == []
    tokens, first = decode_all(decode, "r")
    assert first == 0 and tokens == single_engine(llama_dir, spec, prompt, params)


@pytest.mark.slow
@pytest.mark.parametrize("method, tree", [("mtp", True), ("mtp", False), ("grammar", False)])
def test_forced_first_drafts_count_as_in_one_engine(zoo_dir, method, tree):
    """Issue 37: which of a guided request's first drafts its grammar forced (a tree's forced nodes, a chain's
    forced steps, the grammar method's forced run) crosses with the hand-over, through the header's wire form, so
    the decode side's usage counts them as one engine running the request does: equal forced, draft, accepted
    tokens and steps, equal tokens, a valid output. Before, the first step's forced drafts were counted as guesses
    (and the grammar method handed over no first drafts at all)."""
    from cluster.protocol import DraftsHandover, GrammarHandover, HandoverHeader, PayloadPart
    from zoo.corpus import heldout_cases
    from zoo.prompts import json_schema_prompt

    zoo = Path(zoo_dir)
    schema = heldout_cases()[0]["schema"]
    prompt = json_schema_prompt(schema)
    structured = StructuredOutput(json_schema=json.dumps(schema))
    params = SamplingParams(max_tokens=48, temperature=0.0, structured_output=structured)
    spec = SpecConfig(method=method, k=6, draft=str(zoo / method) if method != "grammar" else None,
                      **(dict(topk=3, num_verify_tokens=6) if tree else {}))
    kw = dict(num_kv_blocks=256, block_size=16, speculative=spec)
    one = LLM(str(zoo / "target"), **kw).generate([prompt], params)[0]

    cfg = EngineConfig(model=str(zoo / "target"), **kw)
    prefill, decode = LLMEngine(cfg), LLMEngine(cfg)
    prefill.add_request("r", prompt, params, prefill_only=True)
    while prefill.requests["r"].status.value != "parked":
        prefill.step()
    h = prefill.take_handover("r")
    assert h.drafts.forced != 0 and (h.drafts.tree is not None) == tree  # the first drafts hold forced tokens
    header = HandoverHeader(h.request, (PayloadPart.KV,),
                            GrammarHandover.of(structured.key(), h.compiled_grammar, structured.plan.backend),
                            DraftsHandover.of(h.drafts))
    back = HandoverHeader.from_wire(header.to_wire())
    assert back.drafts.forced == h.drafts.forced
    blocks = decode.reserve(back.request, back.grammar.serialized)
    decode.kv_cache[:, :, blocks] = prefill.kv_cache[:, :, h.block_ids]
    prefill.release("r")
    decode.commit("r", drafts=back.drafts.with_probs(None))
    outs = decode.step()
    first = decode.requests["r"].metrics
    assert first.num_forced_tokens == (h.drafts.forced & (1 << first.num_draft_tokens) - 1).bit_count() > 0
    while decode.has_unfinished():
        outs += decode.step()
    out = [o for o in outs if o.request_id == "r"][-1]
    assert out.token_ids == one.token_ids and out.speculative == one.speculative, (out.speculative, one.speculative)
    if out.finish_reason == "stop":
        jsonschema.validate(json.loads(out.text), schema)
    assert decode.stats()["kv_blocks_used"] == prefill.stats()["kv_blocks_used"] == 0
