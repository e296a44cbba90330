"""engine/core/scheduler.py and the engine loop: budget, chunked prefill, mixed steps, the running cap,
FCFS, preemption by recompute, and that every block is free after aborts and preemptions."""

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.core.block_manager import BlockManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler


def _req(rid, n, max_tokens=8):
    return Request(rid, list(range(3, 3 + n)), SamplingParams(max_tokens=max_tokens), seed=0, max_total_tokens=512)


def _advance(out):
    """What the engine does after a step, minus the model: computed tokens advance, samplers append."""
    for s in out.scheduled:
        s.request.num_computed_tokens += s.num_new_tokens
        if s.sample:
            s.request.token_ids.append(7)


def test_token_budget_and_chunked_prefill():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    a, b = _req("a", 7), _req("b", 12)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens, s.sample) for s in out.scheduled] == [("a", 7, True), ("b", 3, False)]
    _advance(out)
    out = sched.schedule()  # a decodes one token, b continues its prefill with the rest of the budget
    assert [(s.request.request_id, s.num_new_tokens, s.sample) for s in out.scheduled] == [("a", 1, True), ("b", 9, True)]
    assert out.num_batched_tokens == 10


def test_without_chunked_prefill_long_prompt_waits_for_a_whole_budget():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10, enable_chunked_prefill=False)
    a, b = _req("a", 4), _req("b", 8)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["a"]  # b (8) does not fit in the 6 left
    _advance(out)
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 8)]


def test_running_cap_and_fcfs():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    reqs = [_req(c, 3) for c in "abcd"]
    for r in reqs:
        sched.add(r)
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c", "d"]


def test_preemption_by_recompute_evicts_the_newest():
    # 6 blocks of 2 slots. a and b take 3 blocks each; when a needs a 4th, b (newest) gives way.
    bm = BlockManager(6, 2)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=100)
    a, b = _req("a", 6), _req("b", 6)
    sched.add(a)
    sched.add(b)
    _advance(sched.schedule())
    assert bm.pool.num_free == 0
    out = sched.schedule()
    assert [r.request_id for r in out.preempted] == ["b"]
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1)]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.num_tokens == 7
    assert bm.table("b") == [] and bm.table("a") == [0, 1, 2, 5]
    assert list(sched.waiting) == [b]


def test_engine_frees_every_block_after_aborts_and_preemptions(llama_dir):
    # A cache so small that 8 concurrent requests must preempt each other.
    engine = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=24, block_size=4, max_num_seqs=8,
                                    max_num_batched_tokens=64))
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for i in range(8):
        engine.add_request(f"r{i}", list(range(5, 15 + i)), params)
    finished, steps = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        if steps == 5:
            engine.abort("r2")
            engine.abort("r5")
    preemptions = sum(o.metrics.num_preemptions for o in finished.values())
    assert preemptions > 0, "the test must exercise preemption"
    assert finished["r2"].finish_reason == "abort" and finished["r5"].finish_reason == "abort"
    assert all(finished[f"r{i}"].finish_reason == "length" and len(finished[f"r{i}"].token_ids) == 20
               for i in (0, 1, 3, 4, 6, 7))
    assert engine.stats()["kv_blocks_used"] == 0
    assert engine.blocks.pool.num_free == 24


def test_preempted_outputs_equal_unpreempted(llama_dir):
    """Recompute after preemption gives exactly the tokens an unconstrained run gives."""
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=11, ignore_eos=True)
    prompts = [list(range(5, 15 + i)) for i in range(6)]

    def run(blocks):
        engine = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=blocks, block_size=4, max_num_seqs=8))
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        return done

    roomy, tight = run(256), run(20)
    assert sum(o.metrics.num_preemptions for o in tight.values()) > 0
    assert {k: v.token_ids for k, v in roomy.items()} == {k: v.token_ids for k, v in tight.items()}
