"""A draft head's KV deferred at steps that draft nothing and caught up before the next that drafts
(engine/speculative/deferred_kv.py): the drafts are the ones the head makes when every step runs its pass (same
acceptance, request by request), with prompts joining mid-run, sampled and greedy requests, and preemptions; the
prefix cache registers no block whose head KV waits; a k = 0 step of decoding rows runs no head pass at all."""
from __future__ import annotations

import itertools

import pytest

from engine import LLM, SamplingParams, SpecConfig
from engine.core.block_manager import BlockManager
from engine.core.prefix_cache import PrefixCache
from engine.core.request import Request
from engine.speculative import adaptive as A
from engine.speculative import deferred_kv as D


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread_module):
    """Tiny models: one intra-op thread (tests/engine/conftest.py)."""


# k of successive steps: runs at 0 long enough for holes, then 1-3 (catch-ups), in an order that is not periodic
# with the requests' lengths
SCHEDULE = (0, 0, 0, 0, 1, 3, 0, 0, 2, 0, 0, 0, 3, 3, 1, 0, 0, 2)
PROMPTS = ["Once upon a time", "The little dog", "In the morning the sun", "She said that", "A bird",
           "Tom and Ann went"]


@pytest.fixture
def scheduled_k(monkeypatch):
    """Adaptive k's decisions replaced by SCHEDULE (its own still run): which k a step takes depends on this
    machine's step times otherwise, and deferral is about what happens across changing k."""
    decide = A.AdaptiveK.choose

    def install():
        steps = itertools.cycle(SCHEDULE)

        def choose(self, vote, k_max):
            decide(self, vote, k_max)
            return min(next(steps), k_max)

        monkeypatch.setattr(A.AdaptiveK, "choose", choose)

    return install


def _run(zoo_dir, method: str, defer: bool, **kw):
    llm = LLM(f"{zoo_dir}/target", num_kv_blocks=kw.pop("num_kv_blocks", 256), block_size=4,
              max_num_seqs=kw.pop("max_num_seqs", 3),
              speculative=SpecConfig(method=method, k=3, draft=f"{zoo_dir}/{method}", adaptive_k=True,
                                     defer_draft_kv=defer), **kw)
    params = [SamplingParams(max_tokens=40 + 7 * i, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, params)
    llm.preemptions = sum(o.metrics.num_preemptions for o in outs)
    return llm, [(o.token_ids, o.speculative.draft_tokens, o.speculative.accepted_tokens) for o in outs]


@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_deferred_head_kv_drafts_as_every_pass_would(zoo_dir, scheduled_k, monkeypatch, method):
    """Six requests through three slots (later prompts join running decodes: those steps fill the prompt rows
    only), half of them sampled: tokens and every request's accepted drafts equal the run whose head passes every
    row at every step. The catch-ups ran and covered the deferred rows (without them, accepted counts differ:
    the drafts attend to KV never written)."""
    scheduled_k()
    _, want = _run(zoo_dir, method, defer=False)
    ran = {"catch_ups": 0, "rows": 0, "fills": 0}
    catch_up, plan = D.catch_up, D.plan

    def counted_catch_up(proposer, c, *args):
        ran["catch_ups"] += 1
        ran["rows"] += c.num_rows
        catch_up(proposer, c, *args)

    def counted_plan(*args):
        fill, c = plan(*args)
        ran["fills"] += fill is not None
        return fill, c

    monkeypatch.setattr(D, "catch_up", counted_catch_up)
    monkeypatch.setattr(D, "plan", counted_plan)
    scheduled_k()
    llm, got = _run(zoo_dir, method, defer=True)
    assert llm.engine.runner.proposer.stash is not None
    assert got == want
    assert ran["catch_ups"] >= 10 and ran["rows"] >= 100 and ran["fills"] >= 1, ran
    assert llm.engine.stats()["kv_blocks_used"] == 0


def test_deferred_head_kv_survives_preemption(zoo_dir, scheduled_k):
    """Too few KV blocks for three growing requests: some are preempted and recomputed (their holes are dropped:
    the recomputed rows are prompt rows, which always fill the head's KV); outputs and acceptance unchanged."""
    scheduled_k()
    base, want = _run(zoo_dir, "mtp", defer=False, num_kv_blocks=28, enable_prefix_caching=False)
    scheduled_k()
    llm, got = _run(zoo_dir, "mtp", defer=True, num_kv_blocks=28, enable_prefix_caching=False)
    assert got == want
    assert llm.preemptions > 0 and base.preemptions == llm.preemptions


def test_no_head_pass_at_k0_over_decoding_rows(zoo_dir, monkeypatch):
    """A k = 0 step of decoding requests runs the target alone: the head is not called (its pass is the cost
    deferral saves); with deferral off it is called every step."""
    calls = {}
    for defer in (False, True):
        llm = LLM(f"{zoo_dir}/target", num_kv_blocks=128, block_size=4,
                  speculative=SpecConfig(method="mtp", k=3, draft=f"{zoo_dir}/mtp", adaptive_k=True,
                                         defer_draft_kv=defer))
        monkeypatch.setattr(A.AdaptiveK, "choose", lambda self, vote, k_max: 0)
        head = llm.engine.runner.proposer.head
        n = [0]
        hook = head.register_forward_hook(lambda *_: n.__setitem__(0, n[0] + 1))
        llm.generate(PROMPTS[:2], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
        hook.remove()
        calls[defer] = n[0]
        monkeypatch.undo()
    # deferred: the prompts' step only (it drafts at the configured k: no vote yet), its pass and its chain's two
    assert calls[True] <= 3 < 20 <= calls[False], calls


def test_prefix_cache_registers_no_block_past_the_holes():
    """A block is final for the prefix cache only where the head's KV is written: below draft_holes_from."""
    from engine.sampling_params import SamplingParams as Params

    blocks = BlockManager(16, 4)
    cache = PrefixCache(blocks, "m", draft_lag=1)
    req = Request("r", list(range(1, 30)), Params(max_tokens=4), seed=0, max_total_tokens=64)
    assert cache.admit(req) == 0
    blocks.allocate("r", 29)
    req.num_computed_tokens = 29
    req.draft_holes_from = 9
    assert cache.progress(req) == 2  # blocks 0-1 (positions 0-7); block 2 holds a hole at 8
    req.draft_holes_from = None
    assert cache.progress(req) == 5  # then up to position 27 (draft lag 1): blocks 2-6
    assert req.num_cached_blocks == 7


def test_stash_is_budgeted_with_the_kv(zoo_dir):
    """The stash (one head input per KV slot) counts in a block's bytes, so the KV budget holds it too; only adaptive
    k makes steps without drafts, so a fixed k keeps none."""
    on = LLM(f"{zoo_dir}/target", num_kv_blocks=32, block_size=4,
             speculative=SpecConfig(method="mtp", k=3, draft=f"{zoo_dir}/mtp", adaptive_k=True))
    off = LLM(f"{zoo_dir}/target", num_kv_blocks=32, block_size=4,
              speculative=SpecConfig(method="mtp", k=3, draft=f"{zoo_dir}/mtp", adaptive_k=True,
                                     defer_draft_kv=False))
    fixed = LLM(f"{zoo_dir}/target", num_kv_blocks=32, block_size=4,
                speculative=SpecConfig(method="mtp", k=3, draft=f"{zoo_dir}/mtp"))
    stash = on.engine.runner.proposer.stash
    assert off.engine.runner.proposer.stash is None and fixed.engine.runner.proposer.stash is None
    assert stash.shape[0] == 32 * 4 + 1
    assert on.engine.runner.kv_block_bytes() - off.engine.runner.kv_block_bytes() == 4 * stash.shape[1] * \
        stash.element_size()


def test_a_handed_over_request_defers_and_catches_up_on_the_decode_side(zoo_dir, scheduled_k):
    """Disaggregated: the prefill engine fills the head's KV over the prompt (prompt rows are never deferred) and the
    KV travels; the decode engine defers and catches up as one engine does. Same tokens and accepted drafts as a
    decode engine whose head passes every row."""
    from engine import EngineConfig, LLMEngine
    from tests.engine.test_handover_drafts import decode_all, hand_over

    got = {}
    for defer in (False, True):
        scheduled_k()
        spec = SpecConfig(method="mtp", k=3, draft=f"{zoo_dir}/mtp", adaptive_k=True, defer_draft_kv=defer)
        prefill, decode = (LLMEngine(EngineConfig(model=f"{zoo_dir}/target", num_kv_blocks=64, block_size=4,
                                                  speculative=spec)) for _ in range(2))
        prompt = prefill.tokenizer.encode("Once upon a time there was a little dog")
        hand_over(prefill, decode, "r", prompt, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
        tokens, _ = decode_all(decode, "r")
        got[defer] = (tokens, list(decode.spec_stats.accepted_length_hist), decode.stats()["spec"]["dynamic_k_steps"])
    assert got[True] == got[False]
    assert got[True][2][0] > 0 and sum(got[True][2][1:]) > 0  # it deferred, then drafted
