"""bench/tree.py's configurations: the trees a budget and --shapes name, and SpecConfig accepting every one of them
(no model runs here; tests/engine/speculative/test_tree*.py hold the trees' outputs)."""
from __future__ import annotations

import argparse

import pytest

from bench.tree import configs, parse_shapes, table
from engine import SpecConfig
from engine.config import MAX_K


def test_shapes_parse_and_a_bad_one_names_the_form():
    assert parse_shapes("4x8,8x4") == [(4, 8), (8, 4)]
    for bad in ("4", "4x", "0x8", "4x8x2", "a"):
        with pytest.raises(argparse.ArgumentTypeError, match="TOPKxDEPTH"):
            parse_shapes(bad)


def test_a_budget_past_max_k_keeps_the_longest_chain_and_trees_of_that_budget():
    rows = dict(configs("mtp", "HEAD", 16, False, [(2, 8), (4, 8), (8, 4)]))
    assert list(rows) == ["chain k=8", "tree topk=2 depth=8", "tree topk=4 depth=8", "tree topk=8 depth=4"]
    assert rows["chain k=8"]["k"] == MAX_K and "num_verify_tokens" not in rows["chain k=8"]
    assert {f["num_verify_tokens"] for label, f in rows.items() if "tree" in label} == {16}
    for fields in rows.values():
        SpecConfig(**fields)  # every row is a config the engine takes
    assert [label for label, _ in configs("mtp", "HEAD", 16, False)] == [
        "chain k=8", "tree topk=2 depth=8", "tree topk=4 depth=8"]  # default: depth-first at the longest depth


def test_shorter_chains_sweep_beside_the_chain_of_the_budget():
    """--chain-ks: "the best chain" issue 37 compares against is the best of a sweep, not of two chains."""
    labels = [label for label, _ in configs("mtp", "HEAD", 8, False, [(4, 3)], chain_ks=[2, 3, 8])]
    assert labels == ["chain k=8", "chain k=2", "chain k=3", "tree topk=4 depth=3"]  # k = 8 once
    assert [label for label, _ in configs("mtp", "HEAD", 8, True, [(4, 3)])][:2] == ["chain k=8", "chain k=3"]
    assert dict(configs("mtp", "HEAD", 8, False, [(4, 3)], chain_ks=[2]))["chain k=2"] == dict(
        method="mtp", draft="HEAD", k=2)


def test_a_tree_that_cannot_hold_the_budget_is_refused_by_name():
    with pytest.raises(ValueError, match="tree 2x4 cannot verify --budget 16"):
        configs("mtp", "HEAD", 16, False, [(2, 4)])
    # the default shapes skip what does not fit (depth 3 trees of topk 3 hold at most 9 nodes)
    assert "tree topk=3 depth=3" not in dict(configs("eagle3", "HEAD", 12, True))


def test_the_table_has_a_row_per_run():
    row = {"prompts": "gsm8k", "guided": False, "method": "mtp", "config": "tree topk=4 depth=8", "grammar": "masks",
           "accepted_incl_bonus": 2.19, "accepted_first_round": 2.19, "tok_s": 1.0, "vs_none": 0.5, "lossless": True}
    lines = table([row]).splitlines()
    assert len(lines) == 3 and "| 2.19 -> 2.19 |" in lines[2] and "nodes by est. acceptance" in lines[2]
