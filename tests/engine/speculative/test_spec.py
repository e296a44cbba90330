"""Speculative decoding is lossless: every method, k, batch size and prefill mode gives the greedy
tokens of the engine without speculation (and of transformers); stops inside accepted runs end the
output exactly there; aborts and preemption leave no KV behind; hand-overs carry the draft state."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, EngineConfig, LLMEngine, SamplingParams, SpecConfig
from tests.support.draft_heads import reference_drafts
from tests.support.spec import greedy_params, random_prompts, spec_config, use_graphs


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread_module):
    """Tiny models: one intra-op thread (tests/engine/conftest.py)."""


METHODS = ["mtp", "eagle3", "ngram", "draft_model", "self_draft"]


@pytest.fixture(scope="module")
def reference(llama_dir):
    """Non-speculative greedy outputs of the prompts used below, memoized by (prompt set, max_tokens)."""
    llm = LLM(llama_dir, num_kv_blocks=512, block_size=4)
    memo = {}

    def get(n: int, seed: int = 0, max_tokens: int = 20):
        key = (n, seed, max_tokens)
        if key not in memo:
            memo[key] = [o.token_ids for o in llm.generate(random_prompts(n, seed), greedy_params(max_tokens))]
        return memo[key]

    return get


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("k,batch,chunked", [(1, 1, True), (1, 16, False), (3, 5, True), (3, 16, False),
                                             (5, 16, True), (5, 2, False), (8, 3, True)])
def test_greedy_equals_no_speculation(llama_dir, spec_drafts, reference, method, k, batch, chunked):
    llm = LLM(llama_dir, num_kv_blocks=512, block_size=4, max_num_batched_tokens=48 if chunked else 2048,
              enable_chunked_prefill=chunked, speculative=spec_config(method, k, spec_drafts, llama_dir))
    outs = llm.generate(random_prompts(batch), greedy_params())
    assert [o.token_ids for o in outs] == reference(batch)
    engine = llm.engine
    assert engine.stats()["kv_blocks_used"] == 0 and engine.drafter.num_held == 0
    m = [o.metrics for o in outs]
    assert sum(sum(x.accepted_lengths) for x in m) + batch == sum(len(o.token_ids) for o in outs)
    assert all(x.num_accepted_tokens <= x.num_draft_tokens for x in m)
    if method == "self_draft":  # nothing is ever rejected
        assert all(x.num_accepted_tokens == x.num_draft_tokens > 0 for x in m)
        assert max(engine.stats()["spec"]["accepted_length_hist"]) > 0
        assert engine.stats()["spec"]["mean_accepted_length"] > 0.7 * (k + 1)


def test_greedy_equals_transformers(checkpoints, spec_drafts):
    path, hf = checkpoints["llama"]
    hf.generation_config.eos_token_id = None
    llm = LLM(path, num_kv_blocks=128, block_size=4, speculative=SpecConfig("eagle3", k=3, draft=spec_drafts["eagle3"]))
    prompts = random_prompts(3, seed=5)
    for prompt, out in zip(prompts, llm.generate(prompts, greedy_params(24))):
        ids = torch.tensor([prompt])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)[0, len(prompt):]
        assert out.token_ids == ref.tolist()


def test_logprobs_and_penalties_match_no_speculation(llama_dir, spec_drafts):
    """Penalties count the drafts before each verified position; logprobs are the raw model's."""
    params = greedy_params(16, logprobs=2, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)
    prompts = random_prompts(4, seed=2)
    ref = LLM(llama_dir, num_kv_blocks=128, block_size=4).generate(prompts, params)
    for method in ("self_draft", "ngram"):
        llm = LLM(llama_dir, num_kv_blocks=128, block_size=4,
                  speculative=spec_config(method, 4, spec_drafts, llama_dir))
        for o, r in zip(llm.generate(prompts, params), ref):
            assert o.token_ids == r.token_ids
            assert [lp.token_id for lp in o.logprobs] == o.token_ids
            torch.testing.assert_close([lp.logprob for lp in o.logprobs], [lp.logprob for lp in r.logprobs],
                                       atol=1e-4, rtol=1e-4)
            assert [sorted(lp.top) for lp in o.logprobs] == [sorted(lp.top) for lp in r.logprobs]


def test_seeded_sampling_with_prompt_lookup_equals_no_speculation(llama_dir):
    """Prompt-lookup drafts are verified against the target's own seeded draws, so a seeded request
    gets exactly the tokens it gets without speculation."""
    prompts = random_prompts(6, seed=3)
    params = [SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=100 + i, ignore_eos=True) for i in range(6)]
    ref = LLM(llama_dir, num_kv_blocks=256, block_size=4).generate(prompts, params)
    llm = LLM(llama_dir, num_kv_blocks=256, block_size=4, speculative=SpecConfig("ngram", k=4, prompt_lookup_min=2))
    assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in ref]


def test_a_short_chain_computes_logits_for_its_drafts_only(llama_dir, reference):
    """Prompt lookup often finds fewer than k drafts: an eager step verifies only the columns some request has a
    draft for (StepBatch.verify_width), so the LM head runs on 1 + max drafts rows per request, not k+1; outputs
    stay the engine's without speculation, greedy and with logprobs."""
    llm = LLM(llama_dir, num_kv_blocks=256, block_size=4, speculative=SpecConfig("ngram", k=4, prompt_lookup_min=2))
    model = llm.engine.runner.model
    widths = []
    original = model.compute_logits

    def counting(hidden):
        widths.append(hidden.shape[0])
        return original(hidden)

    model.compute_logits = counting
    prompts = random_prompts(1, seed=0)
    try:
        out = llm.generate(prompts, greedy_params(20))
        logprobs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, logprobs=2, ignore_eos=True))
    finally:
        del model.compute_logits
    assert [o.token_ids for o in out] == reference(1)
    plain = LLM(llama_dir, num_kv_blocks=256, block_size=4).generate(
        prompts, SamplingParams(max_tokens=20, temperature=0, logprobs=2, ignore_eos=True))
    assert logprobs[0].token_ids == plain[0].token_ids
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in logprobs[0].logprobs]),
                               torch.tensor([lp.logprob for lp in plain[0].logprobs]), rtol=1e-4, atol=1e-4)
    assert 1 in widths and max(widths) <= 5, widths  # steps without a match verified one column, none more than k+1
    assert max(widths) > 1, widths  # and lookup found drafts in some steps


def test_first_sampled_token_is_the_plain_samplers(llama_dir, spec_drafts):
    """A request's first token (no drafts yet) is drawn with the sampler's own numbers."""
    prompts = random_prompts(8, seed=4)
    params = [SamplingParams(max_tokens=1, temperature=1.0, seed=i) for i in range(8)]
    ref = [o.token_ids for o in LLM(llama_dir, num_kv_blocks=128, block_size=4).generate(prompts, params)]
    llm = LLM(llama_dir, num_kv_blocks=128, block_size=4, speculative=SpecConfig("eagle3", 3, spec_drafts["eagle3"]))
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref


@pytest.mark.parametrize("method", ["self_draft", "mtp"])
def test_stops_inside_accepted_drafts(llama_dir, spec_drafts, method):
    """EOS, stop ids, stop strings and max_tokens falling inside an accepted run end the output there."""
    prompt = random_prompts(1, seed=9)[0]
    free = LLM(llama_dir, num_kv_blocks=128, block_size=4).generate([prompt], greedy_params(30))[0]
    llm = LLM(llama_dir, num_kv_blocks=128, block_size=4, speculative=spec_config(method, 5, spec_drafts, llama_dir))
    stop_id = free.token_ids[7]
    cut = free.token_ids.index(stop_id) + 1
    out = llm.generate([prompt], greedy_params(30, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == free.token_ids[:cut] and out.finish_reason == "stop" and out.stop_reason == stop_id
    llm.engine.eos_token_ids = frozenset({stop_id})
    out = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0))[0]
    assert out.token_ids == free.token_ids[:cut] and out.finish_reason == "stop"
    llm.engine.eos_token_ids = frozenset()
    for n in (1, 2, 7, 11):
        out = llm.generate([prompt], greedy_params(n))[0]
        assert out.token_ids == free.token_ids[:n] and out.finish_reason == "length"
    stop = free.text[8:11]
    out = llm.generate([prompt], greedy_params(30, stop=[stop]))[0]
    assert out.text == free.text[: free.text.index(stop)] and out.stop_reason == stop
    assert llm.engine.stats()["kv_blocks_used"] == 0


def test_abort_mid_generation_frees_everything(llama_dir, spec_drafts, reference):
    engine = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=256, block_size=4,
                                    speculative=SpecConfig("mtp", 3, spec_drafts["mtp"])))
    prompts = random_prompts(5)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy_params())
    done = {}
    for step in range(30):
        if step == 3:
            assert engine.requests["r1"].spec_token_ids  # aborted while holding drafts and lookahead blocks
            engine.abort("r1")
            engine.abort("r3")
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if not engine.has_unfinished():
            break
    assert done["r1"].finish_reason == done["r3"].finish_reason == "abort"
    for i in (0, 2, 4):
        assert done[f"r{i}"].token_ids == reference(5)[i]
    assert engine.stats()["kv_blocks_used"] == 0 and engine.drafter.num_held == 0


def test_preemption_under_block_pressure(llama_dir, spec_drafts, reference):
    """Too few blocks for everyone's chains and lookahead: requests are preempted and recomputed."""
    llm = LLM(llama_dir, num_kv_blocks=40, block_size=4, speculative=SpecConfig("eagle3", 4, spec_drafts["eagle3"]))
    outs = llm.generate(random_prompts(8), greedy_params())
    assert [o.token_ids for o in outs] == reference(8)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert llm.engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("method", ["mtp", "eagle3", "self_draft", "ngram"])
def test_handover_carries_the_draft_state(checkpoints, llama_dir, spec_drafts, reference, method):
    """Prefill-only on one engine, hand-over (target and draft KV blocks, the first drafts, drafted by the
    prefill in the step that sampled the first token), decode on another: same tokens; the first decode step
    verifies those k drafts (their acceptance counted), and the drafts after it are those of a from-scratch
    recomputation (the draft KV over the prompt arrived)."""
    spec = spec_config(method, 3, spec_drafts, llama_dir)
    prefill = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=64, block_size=4, speculative=spec))
    decode = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=64, block_size=4, speculative=spec))
    prompt = random_prompts(2)[1]
    prefill.add_request("other", random_prompts(2)[0], greedy_params())  # decodes in the same steps as the prefill
    prefill.add_request("r", prompt, greedy_params(), prefill_only=True)
    others = []
    while prefill.requests["r"].status.value != "parked":
        others += prefill.step()
    h = prefill.take_handover("r")
    assert h.request.cache_layers == prefill.kv_cache.shape[0]
    assert h.drafts.probs is None and h.drafts.tree is None  # greedy: its verification reads no distributions
    if method != "ngram":  # drafted by the prefill's step: the first decode step verifies a full chain
        assert len(h.drafts.token_ids) == 3
    blocks = decode.reserve(h.request)
    decode.kv_cache[:, :, blocks] = prefill.kv_cache[:, :, h.block_ids]
    prefill.release("r")
    decode.commit("r", drafts=h.drafts)
    assert decode.requests["r"].spec_token_ids == list(h.drafts.token_ids)
    outs = decode.step()
    req = decode.requests["r"]
    if method != "ngram":
        assert req.metrics.num_draft_tokens == 3
    if method == "self_draft":
        assert req.metrics.num_accepted_tokens == 3
    if method in ("mtp", "eagle3"):
        assert req.spec_token_ids == reference_drafts(checkpoints["llama"][1], spec_drafts[method], method,
                                                      req.token_ids, 3)
    while decode.has_unfinished():
        outs += decode.step()
    assert outs[-1].finished and outs[-1].token_ids == reference(2)[1]
    while prefill.has_unfinished():
        others += prefill.step()
    assert [o for o in others if o.request_id == "other"][-1].token_ids == reference(2)[0]
    assert prefill.stats()["kv_blocks_used"] == decode.stats()["kv_blocks_used"] == 0


def test_handover_between_mismatched_caches_is_refused(llama_dir, spec_drafts):
    from engine import InvalidRequestError

    prefill = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=32, block_size=4))
    decode = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=32, block_size=4,
                                    speculative=SpecConfig("mtp", 2, spec_drafts["mtp"])))
    prefill.add_request("r", [5, 6, 7], greedy_params(), prefill_only=True)
    prefill.step()
    with pytest.raises(InvalidRequestError, match="cache layers"):
        decode.reserve(prefill.take_handover("r").request)


def _mixed_params(n: int) -> list[SamplingParams]:
    """Greedy and seeded sampling, different lengths (so the decoding batch shrinks step by step)."""
    return [SamplingParams(max_tokens=6 + 2 * i, temperature=0.0 if i % 3 else 0.9, top_k=0 if i % 2 else 40,
                           seed=50 + i, ignore_eos=True, logprobs=1 if i == 4 else None) for i in range(n)]


@pytest.mark.parametrize("method", ["eagle3", "self_draft", "ngram"])
def test_padded_decode_layout_equals_eager(llama_dir, spec_drafts, method):
    """The CUDA-graph layout (k+1 rows per request, idle requests up to a captured size, fixed-width
    block tables, static input buffers) gives the eager step's tokens; run here without capture."""
    prompts, params = random_prompts(11, seed=6), _mixed_params(11)
    spec = spec_config(method, 3, spec_drafts, llama_dir)
    eager = LLM(llama_dir, num_kv_blocks=256, block_size=4, speculative=spec).generate(prompts, params)
    llm = LLM(llama_dir, num_kv_blocks=256, block_size=4, speculative=spec)
    graphs = use_graphs(llm, capture=False)
    outs = llm.generate(prompts, params)
    assert graphs.num_runs > 2
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager]
    assert llm.engine.stats()["kv_blocks_used"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["eagle3", "mtp", "self_draft", "ngram"])
def test_cuda_graph_replay_equals_eager(llama_dir, spec_drafts, method):
    """On CUDA: the captured speculative step, replayed with new inputs for padded batch sizes, gives
    the tokens of the same padded step run eagerly (greedy and seeded sampling, drafts, logprobs),
    and those of the unpadded eager step."""
    prompts, params = random_prompts(11, seed=6), _mixed_params(11)
    spec = spec_config(method, 3, spec_drafts, llama_dir)
    kw = dict(device="cuda", dtype="float32", num_kv_blocks=256, block_size=4, max_num_seqs=16)
    eager_llm = LLM(llama_dir, speculative=spec, **kw)
    use_graphs(eager_llm, capture=False, max_batch=16)
    eager = eager_llm.generate(prompts, params)
    llm = LLM(llama_dir, speculative=spec, **kw)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.capture and len(graphs.captured) == len(graphs.sizes)
    outs = llm.generate(prompts, params)
    assert graphs.num_runs > 2 and any(graphs.captured.values())
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager]
    for o, e in zip(outs, eager):
        if o.logprobs is not None:
            torch.testing.assert_close([lp.logprob for lp in o.logprobs], [lp.logprob for lp in e.logprobs])
    unpadded = LLM(llama_dir, speculative=spec, cuda_graphs=False, **kw)
    greedy = [i for i, p in enumerate(params) if p.temperature == 0]
    ref = unpadded.generate([prompts[i] for i in greedy], [params[i] for i in greedy])
    assert [outs[i].token_ids for i in greedy] == [o.token_ids for o in ref]


def test_handovers_beyond_max_num_seqs(llama_dir, spec_drafts, reference):
    """Committed hand-overs join the running batch whatever max_num_seqs says; the draft state
    (distribution slots) grows for them."""
    spec = spec_config("self_draft", 3, spec_drafts, llama_dir)
    prefill = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=128, block_size=4, speculative=spec))
    decode = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=128, block_size=4, max_num_seqs=2,
                                    speculative=spec))
    prompts = random_prompts(5)
    params = [greedy_params()] * 4 + [SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True)]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        prefill.add_request(f"r{i}", p, sp, prefill_only=True)
    while any(r.status.value != "parked" for r in prefill.requests.values()):
        prefill.step()
    for i in range(5):
        h = prefill.take_handover(f"r{i}")
        blocks = decode.reserve(h.request)
        decode.kv_cache[:, :, blocks] = prefill.kv_cache[:, :, h.block_ids]
        prefill.release(f"r{i}")
        assert (h.drafts.probs is not None) == (i == 4)  # the sampled request's drafts come with their distributions
        decode.commit(f"r{i}", drafts=h.drafts)
    done = {}
    while decode.has_unfinished():
        done.update({o.request_id: o for o in decode.step() if o.finished})
    assert [done[f"r{i}"].token_ids for i in range(4)] == reference(5)[:4]
    assert len(done["r4"].token_ids) == 20 and decode.drafter.num_slots >= 5
    assert decode.stats()["kv_blocks_used"] == 0 and decode.drafter.num_held == 0


def test_draft_model_with_another_kv_shape_keeps_its_own_cache(checkpoints, llama_dir, reference):
    """A draft whose KV heads differ from the target's cannot extend its cache tensor: it gets a cache
    of its own over the same block ids (and its requests cannot be handed over)."""
    from engine import InvalidRequestError

    draft = checkpoints["llama3"][0]  # one KV head where the target has two
    llm = LLM(llama_dir, num_kv_blocks=256, block_size=4, speculative=SpecConfig("draft_model", 3, draft))
    spec = llm.engine.drafter
    assert not spec.shares_cache and spec.draft_cache.shape[4] == 1
    assert llm.engine.kv_cache.shape[0] == 2  # the target's layers only
    assert [o.token_ids for o in llm.generate(random_prompts(5), greedy_params())] == reference(5)
    llm.engine.add_request("r", [5, 6, 7], greedy_params(), prefill_only=True)
    llm.engine.step()
    with pytest.raises(InvalidRequestError, match="cache of its own"):
        llm.engine.take_handover("r")
