"""Draft trees under grammars (engine/masking/grammar.py's tree fills): forced runs become single-child stretches;
guided greedy and seeded outputs equal the guided engine without speculation, with masks at expansion and
verification, at verification only, or without forced drafts; every finished output validates against its schema;
expansion masks make the tree's nodes admissible, so it accepts more than with verification masks alone."""
from __future__ import annotations

import json
import jsonschema
import pytest
import torch

from engine import LLM, SamplingParams, SpecConfig, StructuredOutput
from tests.support.tiny import VOCAB


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread_module):
    """Tiny models: one intra-op thread (tests/engine/conftest.py)."""


def _allowed(row: torch.Tensor) -> set[int]:
    """The token ids a packed int32 bitmask row admits."""
    bits = (row[:, None].to(torch.int64) >> torch.arange(32)) & 1
    return set(torch.nonzero(bits.flatten())[:, 0].tolist())


def test_forced_runs_are_single_child_stretches(zoo):
    """GrammarMasker.fill_draft_tree with forced drafts: a node the grammar forces from admits only its forced
    run's next token (the run structured/forced.py gives the chain's drafts, so its one child has probability 1),
    the node on the run continues it without matcher work, a node past the run gets the grammar's own mask, a node
    the grammar refuses stays unmasked (its score is already -inf), and without forced drafts every node gets the
    grammar's own mask."""
    from transformers import AutoTokenizer

    from engine.masking.grammar import GrammarMasker
    from engine.masking.masker import MaskRow
    from structured.compiler import GrammarCompiler
    from structured.forced import ForcedTokenizer, forced_run

    tokenizer = AutoTokenizer.from_pretrained(str(zoo / "target"))
    compiler = GrammarCompiler(tokenizer, len(tokenizer), compile_timeout_s=None)
    structured = StructuredOutput(json_schema=json.dumps(
        {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}))
    first = tokenizer.encode('{"', add_special_tokens=False)
    assert len(first) == 1
    state = compiler.new_state(compiler.compile(structured), structured)
    assert state.accept(first[0])
    run = forced_run(state, ForcedTokenizer(tokenizer), 4, tuple(first))  # `name`, `":` (` "` may merge on)
    assert len(run) == 2
    words = compiler.allocate_bitmask(1).shape[-1]

    def fill(masker, paths: list[list[int]]) -> tuple[list[set[int]], list[bool], list[int]]:
        bitmask = torch.zeros((1, len(paths), words), dtype=torch.int32)
        flags = torch.zeros((1, len(paths)), dtype=torch.bool)
        forced = torch.full((1, len(paths)), -1, dtype=torch.int64)
        emitted = torch.tensor([first + [-1] * 4])  # k = 4, the step emitted `{"`
        masker.fill_draft_tree(emitted, torch.tensor([0]), torch.tensor([paths], dtype=torch.int64), bitmask, flags,
                               forced)
        return [_allowed(r) for r in bitmask[0]], flags[0].tolist(), forced[0].tolist()

    def own_mask(tokens: list[int]) -> set[int]:
        scratch = compiler.allocate_bitmask(1)
        for t in tokens:
            assert state.accept(t)
        state.fill_bitmask(scratch, 0)
        state.rollback(len(tokens))
        return _allowed(scratch[0])

    refused = tokenizer.encode("7", add_special_tokens=False)[0]
    for forced in (True, False):
        masker = GrammarMasker(compiler, ForcedTokenizer(tokenizer) if forced else None)
        masker.add("r", structured)
        assert masker.begin_step((MaskRow("r", (), True),))
        root, _, root_child = fill(masker, [[]])
        depth1, flags1, children1 = fill(masker, [[run[0]], [refused]])
        depth2, _, children2 = fill(masker, [run])
        masker.end_step()
        if forced:  # the forced child is also handed over as a token (the expansion takes it, in vocabulary or not)
            assert root == [{run[0]}] and depth1[0] == {run[1]}
            assert root_child == [run[0]] and children1 == [run[1], -1]
        else:
            assert root == [own_mask([])] and depth1[0] == own_mask(run[:1]) and len(root[0]) > 1
            assert root_child == [-1] and children1 == [-1, -1]
        assert flags1 == [True, False]
        assert depth2 == [own_mask(run)] and len(depth2[0]) > 1 and children2 == [-1]  # the run ended: free again


@pytest.fixture(scope="module")
def cases():
    from zoo.corpus import heldout_cases
    from zoo.prompts import json_schema_prompt

    rows = heldout_cases()[:4]
    return [json_schema_prompt(r["schema"]) for r in rows], [r["schema"] for r in rows]


def _params(schemas) -> list[SamplingParams]:
    """Greedy, and every third request sampled with a seed."""
    return [SamplingParams(max_tokens=128, temperature=0.8 if i % 3 == 1 else 0.0, seed=11 + i,
                           structured_output=StructuredOutput(json_schema=json.dumps(s)))
            for i, s in enumerate(schemas)]


@pytest.fixture(scope="module")
def reference(zoo, cases):
    prompts, schemas = cases
    llm = LLM(str(zoo / "target"), num_kv_blocks=2048, block_size=16)
    return [o.token_ids for o in llm.generate(prompts, _params(schemas))]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_guided_tree_equals_guided_plain_and_validates(zoo, cases, reference, method):
    """A depth-first tree (depth = budget, engine/speculative/tree.py): the full grammar (expansion and verification
    masks, forced runs), verification masks only, and no forced drafts all equal the guided engine without
    speculation; finished outputs validate; expansion masks accept more than verification masks alone, and forced
    runs no less than without them. Forced nodes (the one token a masked row admits) are counted in each request's
    usage, more with forced runs filling the tree, none where the expansion is not masked."""
    prompts, schemas = cases
    lengths, forced = {}, {}
    for variant, kw in {"full": {}, "verify-only": dict(draft_masks=False), "no-forced": dict(forced_drafts=False)}.items():
        spec = SpecConfig(method=method, k=6, draft=str(zoo / method), topk=3, num_verify_tokens=6, **kw)
        llm = LLM(str(zoo / "target"), num_kv_blocks=2048, block_size=16, speculative=spec)
        outs = llm.generate(prompts, _params(schemas))
        assert [o.token_ids for o in outs] == reference, variant
        for o, schema in zip(outs, schemas):
            if o.finish_reason == "stop":
                jsonschema.validate(json.loads(o.text), schema)
        assert sum(o.finish_reason == "stop" for o in outs) >= len(outs) // 2
        lengths[variant] = llm.engine.stats()["spec"]["mean_accepted_length"]
        forced[variant] = sum(o.metrics.num_forced_tokens for o in outs)
        assert forced[variant] <= sum(o.metrics.num_draft_tokens for o in outs)
        assert llm.engine.blocks.pool.num_used == 0
    assert lengths["full"] > lengths["verify-only"], lengths
    assert lengths["full"] >= lengths["no-forced"], lengths
    assert forced["full"] > forced["no-forced"] and forced["verify-only"] == 0, forced


def test_guided_tree_drafts_forced_children_outside_the_draft_vocabulary(zoo, cases, reference, tmp_path):
    """MTP trees under a token map of ids the guided outputs never hold: the head alone proposes no child the target
    accepts, so every accepted node is a grammar-forced child from outside its vocabulary (its masked logits admit
    nothing; the expansion takes the forced token, of probability 1); outputs equal the guided engine's."""
    prompts, schemas = cases
    emitted = {t for ids in reference for t in ids}
    token_map = tmp_path / "map.json"
    token_map.write_text(json.dumps([t for t in range(VOCAB) if t not in emitted][:256]))
    spec = SpecConfig(method="mtp", k=6, draft=str(zoo / "mtp"), topk=3, num_verify_tokens=6,
                      token_map=str(token_map))
    llm = LLM(str(zoo / "target"), num_kv_blocks=2048, block_size=16, speculative=spec)
    outs = llm.generate(prompts, _params(schemas))
    assert [o.token_ids for o in outs] == reference
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert 0 < accepted <= sum(o.metrics.num_forced_tokens for o in outs), accepted
    assert llm.engine.blocks.pool.num_used == 0
