"""Async scheduling (engine/runner/overlap.py) changes when the host reads a step, never what the engine writes:
the same tokens as synchronous stepping for every speculation method, greedy and seeded sampling,
chunked prefill, stops and aborts in flight, KV pressure; steps really are launched ahead; requests the
host must see first (grammars, penalties, prompt lookup) make the engine step synchronously; no KV
block or draft slot is left behind."""
from __future__ import annotations

import pytest

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.runner.overlap import carry_blocker
from tests.support.spec import random_prompts, spec_config


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread_module):
    """Tiny models: one intra-op thread (tests/engine/conftest.py)."""


def _run(llama_dir, spec, prompts, params, **kw):
    """(token ids per prompt, engine) of a fresh LLM."""
    llm = LLM(llama_dir, block_size=4, speculative=spec, **({"num_kv_blocks": 512} | kw))
    outs = llm.generate(prompts, params)
    return [o.token_ids for o in outs], llm.engine


def _both(llama_dir, spec, prompts, params, **kw):
    sync, _ = _run(llama_dir, spec, prompts, params, **kw)
    ahead, engine = _run(llama_dir, spec, prompts, params, async_scheduling=True, **kw)
    return sync, ahead, engine


def _clean(engine) -> None:
    assert engine.stats()["kv_blocks_used"] == 0
    assert not engine.in_flight and not engine.has_unfinished()
    assert engine.drafter.num_held == 0


@pytest.mark.parametrize("method", [None, "mtp", "eagle3", "draft_model", "self_draft"])
@pytest.mark.parametrize("k,batch,seqs,chunked", [(1, 3, 64, True), (3, 9, 4, True), (3, 16, 64, False), (5, 6, 3, True)])
def test_greedy_tokens_equal_synchronous_steps(llama_dir, spec_drafts, method, k, batch, seqs, chunked):
    spec = spec_config(method, k, spec_drafts, llama_dir) if method else None
    params = SamplingParams(max_tokens=17, temperature=0, ignore_eos=True)
    sync, ahead, engine = _both(llama_dir, spec, random_prompts(batch), params, max_num_seqs=seqs,
                                max_num_batched_tokens=24 if chunked else 2048, enable_chunked_prefill=chunked)
    assert ahead == sync
    # most steps were launched before the previous one was read
    assert engine.num_overlapped_steps >= 0.5 * 17 * batch / (seqs * (k + 1 if method else 1))
    _clean(engine)


@pytest.mark.parametrize("method", [None, "mtp", "eagle3", "draft_model"])
def test_seeded_sampling_equals_synchronous_steps(llama_dir, spec_drafts, method):
    """Counter-based sampling draws by (seed, position): positions fixed up on the device give the same
    draws, and drafts are planned as a synchronous step would plan them."""
    spec = spec_config(method, 3, spec_drafts, llama_dir) if method else None
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
    sync, ahead, engine = _both(llama_dir, spec, random_prompts(7, seed=3), params, max_num_seqs=4)
    assert ahead == sync and engine.num_overlapped_steps > 0
    _clean(engine)


def test_stops_inside_a_step_in_flight(llama_dir, spec_drafts):
    """A request that ends at step N already runs in N+1: those rows are dropped, the output ends where
    the synchronous one does (eos, stop token ids, stop strings, max_tokens)."""
    spec = spec_config("mtp", 3, spec_drafts, llama_dir)
    prompts = random_prompts(8, seed=5)
    reference, _ = _run(llama_dir, spec, prompts, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    stop_ids = sorted({r[4] for r in reference})[:3]
    for params in (SamplingParams(max_tokens=30, temperature=0, stop_token_ids=stop_ids),
                   SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=stop_ids),
                   SamplingParams(max_tokens=30, temperature=0, stop=["e", "o"])):
        sync, ahead, engine = _both(llama_dir, spec, prompts, params, max_num_seqs=5)
        assert ahead == sync
        _clean(engine)


def test_abort_while_in_flight(llama_dir, spec_drafts):
    spec = spec_config("eagle3", 3, spec_drafts, llama_dir)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    reference, _ = _run(llama_dir, spec, random_prompts(5), params)
    engine = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=256, block_size=4, speculative=spec,
                                    async_scheduling=True))
    for i, p in enumerate(random_prompts(5)):
        engine.add_request(f"r{i}", p, params)
    done = {}
    for step in range(60):
        if step == 4:
            assert "r1" in engine.in_flight
            engine.abort("r1")
            engine.abort("r3")
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done
                done[out.request_id] = out
        if not engine.has_unfinished():
            break
    assert done["r1"].finish_reason == done["r3"].finish_reason == "abort"
    for i in (0, 2, 4):
        assert done[f"r{i}"].token_ids == reference[i]
    _clean(engine)


def test_kv_pressure_falls_back_to_synchronous_steps(llama_dir, spec_drafts):
    """Too few blocks: planning ahead never preempts (it would free KV the running step writes); the engine
    reads the running step first and lets the synchronous scheduler preempt."""
    spec = spec_config("mtp", 4, spec_drafts, llama_dir)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    sync, ahead, engine = _both(llama_dir, spec, random_prompts(8), params, num_kv_blocks=40)
    assert ahead == sync
    _clean(engine)


def test_host_dependent_requests_step_synchronously(llama_dir, spec_drafts):
    """Penalties (counts from the output tokens) and prompt lookup (drafts from the tokens) need step N read
    before N+1 is planned: with such a request running, nothing is launched ahead; outputs stay equal."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    penalized = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, repetition_penalty=1.3)
    prompts = random_prompts(4)
    spec = spec_config("mtp", 3, spec_drafts, llama_dir)
    for mixed, expect_overlap in (([params] * 4, True), ([params, penalized, params, params], False)):
        sync, ahead, engine = _both(llama_dir, spec, prompts, mixed)
        assert ahead == sync
        assert (engine.num_overlapped_steps > 0) == expect_overlap
    sync, ahead, engine = _both(llama_dir, spec_config("ngram", 3, spec_drafts, llama_dir), prompts, params)
    assert ahead == sync and engine.num_overlapped_steps == 0


def test_carry_blockers():
    from engine.core.request import Request
    from structured.request import StructuredOutput

    def req(**kw):
        return Request("r", [1, 2], SamplingParams(**kw), seed=0, max_total_tokens=64)

    assert carry_blocker(req(), drafts_on_host=False) is None
    assert carry_blocker(req(), drafts_on_host=True) == "prompt lookup"
    assert carry_blocker(req(presence_penalty=0.5), False) == "penalties"
    assert carry_blocker(req(structured_output=StructuredOutput(json_object=True)), False) == "grammar"
    prefill = req()
    prefill.prefill_only = True
    assert carry_blocker(prefill, False) == "prefill-only"


def test_handover_committed_while_a_step_is_in_flight(llama_dir, spec_drafts):
    """The decode side of a hand-over: a request reserved and committed between steps joins while another
    request's step is in flight (the engine reads that step first, drafts for the newcomer, then plans
    ahead again); both outputs equal the synchronous engine's."""
    spec = spec_config("mtp", 3, spec_drafts, llama_dir)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    reference, _ = _run(llama_dir, spec, random_prompts(2), params)
    prefill = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=64, block_size=4, speculative=spec))
    decode = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=64, block_size=4, speculative=spec,
                                    async_scheduling=True))
    decode.add_request("a", random_prompts(2)[0], params)
    outs = decode.step() + decode.step() + decode.step()
    assert decode.in_flight
    prefill.add_request("r", random_prompts(2)[1], params, prefill_only=True)
    while prefill.requests["r"].status.value != "parked":
        prefill.step()
    h = prefill.take_handover("r")
    blocks = decode.reserve(h.request)
    decode.kv_cache[:, :, blocks] = prefill.kv_cache[:, :, h.block_ids]
    prefill.release("r")
    decode.commit("r", drafts=h.drafts)
    while decode.has_unfinished():
        outs += decode.step()
    final = {o.request_id: o.token_ids for o in outs if o.finished}
    assert final == {"a": reference[0], "r": reference[1]}
    assert decode.num_overlapped_steps > 0
    _clean(decode)


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_cuda_async_scheduling_equals_synchronous(llama_dir, spec_drafts, graphs):
    """On a GPU the launch really returns before the step ends: graph replays (their static outputs copied
    before the next replay) and eager steps give the synchronous tokens, greedy and seeded."""
    spec = spec_config("mtp", 3, spec_drafts, llama_dir)
    for params in (SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                   SamplingParams(max_tokens=24, temperature=0.8, seed=5, ignore_eos=True)):
        sync, ahead, engine = _both(llama_dir, spec, random_prompts(6), params, device="cuda", cuda_graphs=graphs,
                                    max_num_seqs=4)
        assert ahead == sync and engine.num_overlapped_steps > 0
        _clean(engine)
