"""Prefix caching through the hand-over (engine/handovers.py pin/unpin/reserve, engine/handover.py
reused_blocks): a decode engine that holds a prompt's leading blocks pins them, the prefill's payload
carries only the rest, and the outputs equal those of full hand-overs into an engine without a cache
(greedy, seeded, speculative); every block reference comes back; a pinned prefix survives eviction
pressure; a prefix evicted before the pin means a full hand-over, which still succeeds."""
from __future__ import annotations

import pytest

from engine import EngineConfig, InvalidRequestError, LLMEngine, SamplingParams
from tests.support.spec import greedy_params, spec_config

BLOCK = 4
SHARED = list(range(40, 40 + 26))  # 26 shared tokens: 6 full blocks
TAILS = [[300, 301, 302], [7, 8, 9, 10, 11], [99]]


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread_module):
    """Tiny models: one intra-op thread (tests/engine/conftest.py)."""


def _engine(llama_dir, spec=None, prefix_caching=True, blocks=96) -> LLMEngine:
    return LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=blocks, block_size=BLOCK, speculative=spec,
                                  enable_prefix_caching=prefix_caching))


def _prefill(prefill: LLMEngine, rid: str, prompt: list[int], params: SamplingParams):
    prefill.add_request(rid, prompt, params, prefill_only=True)
    while prefill.requests[rid].status.value != "parked":
        prefill.step()
    return prefill.take_handover(rid)


def _hand_over(prefill: LLMEngine, decode: LLMEngine, rid: str, prompt: list[int], params: SamplingParams,
               pin: bool = True, stocked: bool = False) -> int:
    """Prefill `prompt`, pin what `decode` holds of it, send only the rest; -> the blocks reused."""
    handover = _prefill(prefill, rid, prompt, params)
    reused = decode.handovers.pin(rid, prompt, params.cache_salt) if pin else 0
    handover = handover.reusing(reused)
    assert handover.request.reused_blocks == reused
    payload = handover.payload_block_ids
    set_aside = decode.blocks.set_aside(len(payload)) if stocked else None
    if stocked:
        decode.kv_cache[:, :, set_aside] = prefill.kv_cache[:, :, payload]
    blocks = decode.reserve(handover.request, block_ids=set_aside)
    assert len(blocks) == len(payload) == handover.request.num_blocks - reused
    if not stocked:
        decode.kv_cache[:, :, blocks] = prefill.kv_cache[:, :, payload]
    prefill.release(rid)
    decode.commit(rid, drafts=handover.drafts)
    return reused


def _run(engine: LLMEngine) -> dict[str, list[int]]:
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return done


def _no_block_held(engine: LLMEngine) -> None:
    pool = engine.blocks.pool
    assert engine.stats()["kv_blocks_used"] == 0 and engine.handovers.num_pinned == 0
    assert all(pool.refs(b) == 0 for b in range(pool.num_blocks))


def _reference(llama_dir, prompts, params, spec=None) -> list[list[int]]:
    """Full hand-overs into a decode engine without a prefix cache, one at a time."""
    prefill, decode = _engine(llama_dir, spec, prefix_caching=False), _engine(llama_dir, spec, prefix_caching=False)
    out = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        _hand_over(prefill, decode, f"ref{i}", p, sp, pin=False)
        out.append(_run(decode)[f"ref{i}"])
    return out


@pytest.mark.parametrize("method", [None, "mtp", "eagle3"])
@pytest.mark.parametrize("stocked", [False, True])
def test_partial_handover_equals_full(llama_dir, spec_drafts, method, stocked):
    """A second and third request sharing a 6-block prefix with one the decode engine ran receive only
    their other blocks, one of them while the first is still decoding; outputs equal full hand-overs."""
    spec = spec_config(method, 3, spec_drafts, llama_dir) if method else None
    prompts = [SHARED + t for t in TAILS]
    params = [greedy_params(12), SamplingParams(max_tokens=12, temperature=0.9, seed=5, ignore_eos=True),
              greedy_params(12)]
    if method:  # seeded speculative outputs depend on the drafting schedule (issue 35): greedy only
        params[1] = greedy_params(12)
    prefill, decode = _engine(llama_dir, spec), _engine(llama_dir, spec)
    outs = {}
    assert _hand_over(prefill, decode, "a", prompts[0], params[0], stocked=stocked) == 0  # nothing cached yet
    for _ in range(3):
        decode.step()
    assert _hand_over(prefill, decode, "b", prompts[1], params[1], stocked=stocked) == len(SHARED) // BLOCK
    outs.update(_run(decode))
    assert _hand_over(prefill, decode, "c", prompts[2], params[2], stocked=stocked) == len(SHARED) // BLOCK
    outs.update(_run(decode))
    assert [outs[r] for r in "abc"] == _reference(llama_dir, prompts, params, spec)
    assert decode.handovers.blocks_reused == 2 * (len(SHARED) // BLOCK)
    _no_block_held(decode)
    _no_block_held(prefill)


def test_next_turn_reuses_the_answer(llama_dir):
    """A follow-up whose prompt is the first turn's prompt and answer reuses the answer's blocks too: the
    handed-over blocks and those the decode engine computed joined its cache."""
    prefill, decode = _engine(llama_dir), _engine(llama_dir)
    first = SHARED + TAILS[0]
    _hand_over(prefill, decode, "t1", first, greedy_params(10))
    answer = _run(decode)["t1"]
    follow_up = first + answer + [5, 6, 7]
    reused = _hand_over(prefill, decode, "t2", follow_up, greedy_params(8))
    assert reused == (len(first) + len(answer) - 1) // BLOCK  # all but the block the last answer token's KV is in
    assert _run(decode)["t2"] == _reference(llama_dir, [follow_up], [greedy_params(8)])[0]
    _no_block_held(decode)


def test_pinned_prefix_survives_eviction_pressure(llama_dir):
    """Between the pin and the payload other requests need every free block: the pinned ones are not
    evicted, and the hand-over that relies on them decodes as a full one would."""
    prefill, decode = _engine(llama_dir), _engine(llama_dir, blocks=24)
    prompts = [SHARED + TAILS[0], SHARED + TAILS[1]]
    _hand_over(prefill, decode, "a", prompts[0], greedy_params(6))
    _run(decode)
    handover = _prefill(prefill, "b", prompts[1], greedy_params(6))
    reused = decode.handovers.pin("b", prompts[1])
    assert reused == len(SHARED) // BLOCK
    # Other requests take every other block (evicting whatever cached block is not pinned).
    for i in range(3):
        decode.add_request(f"x{i}", [200 + i] * 20, greedy_params(4))
    _run(decode)
    assert decode.blocks.pool.num_evicted > 0
    handover = handover.reusing(reused)
    blocks = decode.reserve(handover.request)
    decode.kv_cache[:, :, blocks] = prefill.kv_cache[:, :, handover.payload_block_ids]
    prefill.release("b")
    decode.commit("b", drafts=handover.drafts)
    assert _run(decode)["b"] == _reference(llama_dir, prompts[1:], [greedy_params(6)])[0]
    _no_block_held(decode)


def test_prefix_evicted_before_the_pin_still_succeeds(llama_dir):
    """The router chose this decode engine for its prefix, which was evicted before the request was opened
    there: the pin finds nothing, the whole prompt travels, the output is the same."""
    prefill, decode = _engine(llama_dir), _engine(llama_dir)
    prompts = [SHARED + TAILS[0], SHARED + TAILS[1]]
    _hand_over(prefill, decode, "a", prompts[0], greedy_params(6))
    _run(decode)
    assert decode.blocks.pool.reset_cache() > 0  # evicted: every unheld cached block forgotten
    assert _hand_over(prefill, decode, "b", prompts[1], greedy_params(6)) == 0
    assert _run(decode)["b"] == _reference(llama_dir, prompts[1:], [greedy_params(6)])[0]
    _no_block_held(decode)


def test_pins_are_given_back(llama_dir):
    """unpin (a cancelled request), a hand-over that reuses fewer blocks than were pinned, and one that
    claims more than are pinned (refused with a typed error) all leave no reference behind; the pinned
    blocks stay cached."""
    prefill, decode = _engine(llama_dir), _engine(llama_dir)
    prompt = SHARED + TAILS[0]
    _hand_over(prefill, decode, "a", prompt, greedy_params(4))
    _run(decode)
    cached = decode.blocks.pool.num_cached
    whole = (len(prompt) - 1) // BLOCK  # the same prompt again: all but its last block is cached
    assert decode.handovers.pin("gone", prompt) == whole
    assert decode.stats()["kv_blocks_used"] == whole
    with pytest.raises(InvalidRequestError):
        decode.handovers.pin("gone", prompt)  # one pin per request id
    decode.handovers.unpin("gone")
    decode.handovers.unpin("gone")  # idempotent
    _no_block_held(decode)
    assert decode.blocks.pool.num_cached == cached

    # The prefill sends everything although the decode side pinned: the pins are given back at reserve.
    assert _hand_over(prefill, decode, "full", prompt, greedy_params(4), pin=False) == 0
    decode.handovers.pin("over", prompt)
    handover = _prefill(prefill, "over", prompt, greedy_params(4))
    decode.reserve(handover.request)  # reused_blocks 0: the pin is dropped
    decode.abort("over")
    _run(decode)
    prefill.release("over")
    _no_block_held(decode)

    # The hand-over relies on blocks nobody pinned: refused, nothing held.
    handover = _prefill(prefill, "claim", prompt, greedy_params(4)).reusing(3)
    with pytest.raises(InvalidRequestError, match="holds 0"):
        decode.reserve(handover.request)
    prefill.release("claim")
    _no_block_held(decode)

    # The pinned blocks hold another prompt than the hand-over's (the two sides disagree): refused.
    assert decode.handovers.pin("other", prompt) == whole
    handover = _prefill(prefill, "other", [1] + prompt[1:], greedy_params(4)).reusing(whole)
    with pytest.raises(InvalidRequestError, match="another prompt"):
        decode.reserve(handover.request)
    prefill.release("other")
    _no_block_held(decode)
    _no_block_held(prefill)


def test_aborted_reservation_caches_nothing(llama_dir):
    """Regression: a reserved hand-over aborted before its payload landed registered its blocks (unwritten
    KV) in the prefix cache on its way out; a later request would have reused garbage."""
    prefill, decode = _engine(llama_dir), _engine(llama_dir)
    handover = _prefill(prefill, "r", SHARED + TAILS[0], greedy_params(4))
    decode.reserve(handover.request)
    decode.abort("r")
    _run(decode)
    prefill.release("r")
    assert decode.blocks.pool.num_cached == 0
    _no_block_held(decode)


def test_reused_blocks_must_leave_the_last_block_to_travel(llama_dir):
    prefill = _engine(llama_dir)
    handover = _prefill(prefill, "r", SHARED, greedy_params(4))  # 26 tokens: blocks 0..5 reusable, 6 travels
    assert handover.reusing(99).request.reused_blocks == 6
    d = handover.request.to_dict() | {"reused_blocks": 7}
    with pytest.raises(InvalidRequestError, match="last token"):
        type(handover.request).from_dict(d)
    prefill.release("r")
