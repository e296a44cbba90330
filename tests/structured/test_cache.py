"""structured/cache.py: the compiled-grammar cache keeps at most N entries and B bytes, evicting the
least recently used first; a pending compile counts 0 bytes until it settles; an entry larger than the
whole bound is not kept; a failed compile leaves. Sizes come from `len` of string values here, and from
xgrammar's memory_size_bytes in the GrammarCompiler test."""
from __future__ import annotations

from concurrent.futures import Future

import pytest

from structured.cache import GrammarCache


def done(value) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


def cache(max_entries: int = 100, max_bytes: int = 10) -> GrammarCache:
    return GrammarCache(max_entries, max_bytes, size_of=len)


def test_byte_bound_evicts_least_recently_used_first():
    c = cache(max_bytes=10)
    for key, value in [("a", "xxx"), ("b", "xxx"), ("c", "xxx")]:
        c.put(key, done(value))
    assert c.keys() == ["a", "b", "c"] and c.nbytes == 9
    assert c.get("a") is not None  # a is now the most recently used
    c.put("d", done("xx"))  # 11 bytes: b goes, not a
    assert c.keys() == ["c", "a", "d"] and c.nbytes == 8
    c.put("e", done("xxxxxx"))  # 14 bytes: c, then a go
    assert c.keys() == ["d", "e"] and c.nbytes == 8


def test_count_bound_evicts_least_recently_used_first():
    c = cache(max_entries=2, max_bytes=1000)
    c.put("a", done("x"))
    c.put("b", done("x"))
    c.get("a")
    c.put("c", done("x"))
    assert c.keys() == ["a", "c"]


def test_a_pending_entry_counts_when_it_settles():
    c = cache(max_bytes=10)
    c.put("a", done("xxxx"))
    pending: Future = Future()
    c.put("b", pending)
    c.put("c", done("xxxx"))
    assert c.keys() == ["a", "b", "c"] and c.nbytes == 8
    c.settle("b", pending, "xxxx")  # 12 bytes: a (least recently used) goes
    assert c.keys() == ["b", "c"] and c.nbytes == 8


def test_an_entry_larger_than_the_bound_is_not_kept_and_evicts_nothing():
    c = cache(max_bytes=10)
    c.put("a", done("xxxx"))
    c.put("big", done("x" * 11))
    assert c.keys() == ["a"] and c.nbytes == 4
    pending: Future = Future()
    c.put("big2", pending)
    c.settle("big2", pending, "x" * 11)
    assert c.keys() == ["a"] and c.nbytes == 4


def test_a_failed_or_replaced_entry():
    c = cache()
    failed: Future = Future()
    c.put("a", failed)
    failed.set_exception(RuntimeError("no"))
    assert c.get("a") is None  # stale before its callback runs
    c.settle("a", failed, None)
    assert c.keys() == [] and c.nbytes == 0
    old: Future = Future()
    c.put("b", old)
    c.put("b", done("xx"))  # replaced: the old future settling later changes nothing
    c.settle("b", old, "xxxxxxxx")
    assert c.keys() == ["b"] and c.nbytes == 2


def test_bounds_must_leave_room():
    with pytest.raises(ValueError):
        GrammarCache(0, 10)
    with pytest.raises(ValueError):
        GrammarCache(10, 0)
