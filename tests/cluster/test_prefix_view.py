"""cluster/prefix_view.py: the BlockFilter of a real engine's prefix cache, rebuilt only when the cache changed
(and, for a decode rank, at most every min_interval_s); `changed` hands out each new view once."""
from __future__ import annotations

from cluster.prefix_view import PrefixView
from cluster.protocol.block_filter import BlockFilter
from engine import LLM, SamplingParams
from engine.core.prefix_hash import extend_hashes, namespace_hash


def test_the_view_holds_the_cached_prompt_blocks_and_is_sent_once_per_change(tiny_model_dir):
    llm = LLM(tiny_model_dir, num_kv_blocks=64, block_size=4)
    eng = llm.engine
    now = [0.0]
    view = PrefixView(min_interval_s=0.5, clock=lambda: now[0])
    assert view.changed(eng) == b""  # nothing cached yet: an empty filter, sent once
    assert view.changed(eng) is None
    prompt = list(range(5, 30))  # 25 tokens: 6 full blocks
    llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    now[0] = 1.0
    bits = view.changed(eng)
    pc = eng.prefix_cache
    hashes = extend_hashes([], prompt[:24], pc.block_size, namespace_hash(pc.model))
    assert bits and BlockFilter(bits).leading_matches(hashes) >= 5  # the last prompt block may be partly output
    assert view.changed(eng) is None  # unchanged since: nothing to send
    llm.generate([list(range(100, 125))], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    now[0] = 1.2
    assert view.changed(eng) is None  # changed, but within min_interval_s of the last build
    now[0] = 1.6
    later = view.changed(eng)
    assert later is not None and BlockFilter(later).leading_matches(hashes) >= 5
    llm.generate([list(range(200, 225))], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert view.changed(eng) is None and view.changed(eng, force=True) is not None  # forced: at once


def test_no_prefix_cache_means_an_empty_view(tiny_model_dir):
    llm = LLM(tiny_model_dir, num_kv_blocks=64, block_size=4, enable_prefix_caching=False)
    view = PrefixView()
    assert view.bits(llm.engine) == b"" and view.changed(llm.engine) == b"" and view.changed(llm.engine) is None
