"""engine/core/prefix_cache.py: admission reuses the longest cached prefix (never the block of the last
token), progress registers only final blocks (one token later with a draft head's KV), salts isolate."""
from engine.core.block_manager import BlockManager
from engine.core.prefix_cache import PrefixCache
from engine.core.request import Request
from engine.sampling_params import SamplingParams


def _req(rid, tokens, salt=None):
    return Request(rid, list(tokens), SamplingParams(max_tokens=8, cache_salt=salt), seed=0, max_total_tokens=512)


def _run_prefill(cache: PrefixCache, req: Request) -> None:
    """What the engine does for a prompt: allocate, compute it all, register."""
    cache.admit(req)
    assert cache.blocks.allocate(req.request_id, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    cache.progress(req)


def test_a_shared_prefix_is_computed_once():
    cache = PrefixCache(BlockManager(32, 4), "m")
    system = list(range(100, 112))  # three full blocks
    a, b = _req("a", system + [1, 2]), _req("b", system + [3, 4, 5])
    _run_prefill(cache, a)
    assert cache.admit(b) == 12 and b.num_computed_tokens == 12
    assert cache.blocks.table("b") == cache.blocks.table("a")[:3]
    assert (cache.stats.queries, cache.stats.hits) == (14 + 15, 12)


def test_a_prompt_of_whole_blocks_recomputes_its_last_block():
    cache = PrefixCache(BlockManager(32, 4), "m")
    a = _req("a", range(8))
    _run_prefill(cache, a)
    b = _req("b", range(8))
    assert cache.admit(b) == 4  # the block with token 7 is computed again, in a block of b's own


def test_a_draft_head_makes_blocks_final_one_token_later():
    cache = PrefixCache(BlockManager(32, 4), "m", draft_lag=1)
    a = _req("a", range(8))
    cache.admit(a)
    cache.blocks.allocate("a", 8)
    a.num_computed_tokens = 8
    assert cache.progress(a) == 1  # block 1's last position still waits for its draft KV
    a.token_ids.append(42)
    a.num_computed_tokens = 9
    assert cache.progress(a) == 1


def test_salts_and_models_do_not_share():
    blocks = BlockManager(32, 4)
    cache = PrefixCache(blocks, "m")
    _run_prefill(cache, _req("a", range(9), salt="tenant-1"))
    assert cache.admit(_req("b", range(9), salt="tenant-2")) == 0
    assert cache.admit(_req("c", range(9))) == 0
    assert cache.admit(_req("d", range(9), salt="tenant-1")) == 8
    assert PrefixCache(blocks, "another-model").admit(_req("e", range(9), salt="tenant-1")) == 0


def test_a_request_that_holds_blocks_is_not_looked_up_again():
    cache = PrefixCache(BlockManager(32, 4), "m")
    a = _req("a", range(9))
    _run_prefill(cache, a)
    assert cache.admit(a) == 0 and cache.stats.queries == 9


def test_a_bad_salt_is_refused_naming_the_field():
    import pytest

    from engine.errors import InvalidRequestError

    for bad in ("", 7, "x" * 257):
        with pytest.raises(InvalidRequestError, match="cache_salt"):
            SamplingParams(cache_salt=bad)


def test_a_request_waits_for_the_running_one_computing_its_prefix():
    """Two arrivals with one prefix: the second is deferred while the first computes it, then admitted as a hit."""
    from engine.core.prefix_cache import DEFER
    from engine.core.request import RequestStatus

    cache = PrefixCache(BlockManager(32, 4), "m", min_wait_tokens=4)
    system = list(range(100, 112))
    a, b = _req("a", system + [1, 2]), _req("b", system + [3])
    assert cache.admit(a) == 0
    cache.blocks.allocate("a", a.num_tokens)
    a.status = RequestStatus.RUNNING
    assert cache.admit(b) == DEFER and cache.stats.deferred == 1
    a.num_computed_tokens = 8  # a chunk: two of its three blocks are final
    cache.progress(a)
    assert cache.admit(b) == DEFER  # the third block is still being computed
    a.num_computed_tokens = a.num_tokens
    cache.progress(a)
    assert cache.admit(b) == 12 and cache.blocks.table("b") == cache.blocks.table("a")[:3]


def test_nobody_waits_on_a_request_that_stopped_computing():
    from engine.core.request import RequestStatus

    cache = PrefixCache(BlockManager(32, 4), "m", min_wait_tokens=4)
    a, b = _req("a", range(13)), _req("b", range(13))
    cache.admit(a)
    cache.blocks.allocate("a", 13)
    a.status = RequestStatus.RUNNING
    cache.forget(a)  # preempted or finished before its blocks were cached
    assert cache.admit(b) == 0  # computes the prefix itself
    c = _req("c", range(13))
    a.status = RequestStatus.WAITING  # a finished/parked/preempted owner is not waited on either
    assert cache.admit(c) != -1


def test_a_short_shared_run_is_computed_again_rather_than_waited_for():
    """A chat template's few shared tokens: waiting a step costs more than computing them."""
    from engine.core.request import RequestStatus

    cache = PrefixCache(BlockManager(64, 4), "m", min_wait_tokens=16)
    a = _req("a", list(range(8)) + [50] * 20)
    cache.admit(a)
    cache.blocks.allocate("a", a.num_tokens)
    a.status = RequestStatus.RUNNING
    assert cache.admit(_req("b", list(range(8)) + [60] * 20)) == 0  # two shared blocks (8 tokens) < 16: no wait
    assert cache.admit(_req("c", list(range(8)) + [50] * 20)) == -1  # the whole prompt, 6 blocks: it waits
