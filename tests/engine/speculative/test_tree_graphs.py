"""Draft trees through the engine's fixed-shape decode step (engine/runner/graphs.py): N + 1 rows per request,
idle requests up to the padded size carrying an empty tree in the scratch slot, fixed-width block tables; guided
batches too (their tree fills staged as host functions). Run here without capture (the same padded layout and static
buffers, eagerly); on CUDA with capture."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from engine import LLM, SamplingParams, SpecConfig, StructuredOutput

from tests.support.spec import use_graphs


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread_module):
    """Tiny models: one intra-op thread (tests/engine/conftest.py)."""


def _params(n: int) -> list[SamplingParams]:
    """Greedy and seeded-sampled requests; short max_tokens cut some trees to their first nodes (fewer than N
    nodes in the padded N + 1 rows)."""
    lengths = (24, 5, 24, 3, 24)
    return [SamplingParams(max_tokens=lengths[i], ignore_eos=True, **(dict(temperature=0) if i % 2 == 0 else
                                                                      dict(temperature=0.8, seed=70 + i)))
            for i in range(n)]


def _tree(zoo: Path) -> SpecConfig:
    return SpecConfig(method="mtp", k=3, draft=str(zoo / "mtp"), topk=3, num_verify_tokens=8)


@pytest.mark.parametrize("n,overlap", [(1, False), (3, False), (5, False), (5, True)])
def test_padded_tree_layout_equals_eager(zoo, json_prompts, n, overlap):
    """Batches of 1, 3 and 5 requests (padded to 1, 4 and 8), also with async scheduling (a step's tree requests
    carried on the device into the padded rows): every token equals the engine without speculation, every request
    accepts what it accepts under the eager synchronous tree engine, step by step, and all blocks are free."""
    params = _params(n)
    plain = LLM(str(zoo / "target"), num_kv_blocks=1024, block_size=16).generate(json_prompts[:n], params)
    eager = LLM(str(zoo / "target"), num_kv_blocks=1024, block_size=16, speculative=_tree(zoo))
    eager_outs = eager.generate(json_prompts[:n], params)
    llm = LLM(str(zoo / "target"), num_kv_blocks=1024, block_size=16, speculative=_tree(zoo),
              async_scheduling=overlap)
    graphs = use_graphs(llm, capture=False, max_batch=8)
    outs = llm.generate(json_prompts[:n], params)
    assert graphs.num_runs > 2
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert [o.metrics.accepted_lengths for o in outs] == [o.metrics.accepted_lengths for o in eager_outs]
    assert llm.engine.blocks.pool.num_used == 0


def test_padded_trees_under_preemption(zoo, json_prompts):
    """A small KV pool preempts requests mid-run (recomputed, drafting anew) while the others keep replaying the
    padded step: tokens equal no speculation and every block is free afterwards."""
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)] * 5
    plain = LLM(str(zoo / "target"), num_kv_blocks=1024, block_size=16).generate(json_prompts, params)
    llm = LLM(str(zoo / "target"), num_kv_blocks=40, block_size=16, speculative=_tree(zoo), max_num_seqs=5)
    graphs = use_graphs(llm, capture=False, max_batch=8)
    outs = llm.generate(json_prompts, params)
    assert graphs.num_runs > 2 and sum(o.metrics.num_preemptions for o in outs) > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert llm.engine.blocks.pool.num_used == 0


def _guided(n: int) -> tuple[list[dict], list[SamplingParams]]:
    """(schemas, parameters) of n requests for json_prompts[:n] under their own schemas; every third sampled with a
    seed."""
    from zoo.corpus import heldout_cases

    schemas = [row["schema"] for row in heldout_cases()[:n]]
    params = [SamplingParams(max_tokens=96, temperature=0.8 if i % 3 == 1 else 0.0, seed=31 + i,
                             structured_output=StructuredOutput(json_schema=json.dumps(s)))
              for i, s in enumerate(schemas)]
    return schemas, params


def _check_guided(outs, ref, schemas) -> None:
    """Tokens equal the reference's; finished outputs validate against their schemas (most finish)."""
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    for o, schema in zip(outs, schemas):
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), schema)
    assert sum(o.finish_reason == "stop" for o in outs) >= len(outs) - 1


def _guided_tree(zoo: Path) -> SpecConfig:
    """Nodes ranked by draft probability: each request's trees are its own (a learned table would carry when a
    grammar finished compiling, wall-clock time, into the other requests' trees), so acceptance compares exactly."""
    return SpecConfig(method="mtp", k=3, draft=str(zoo / "mtp"), topk=3, num_verify_tokens=8, tree_score="draft")


def test_guided_tree_batches_take_the_padded_layout(zoo, json_prompts):
    """A guided tree step takes the padded (graph) layout like a guided chain's: its verification and expansion
    fills get the trees' parents and paths as device tensors, staged to host buffers for host functions
    (engine/masking/graph.py, run in place here). Greedy and seeded sampled tokens equal the guided engine without
    speculation and the eager tree engine's, step by step (the same acceptance), and finished outputs validate."""
    schemas, params = _guided(3)
    kw = dict(num_kv_blocks=1024, block_size=16)
    plain = LLM(str(zoo / "target"), **kw).generate(json_prompts[:3], params)
    eager = LLM(str(zoo / "target"), speculative=_guided_tree(zoo), **kw).generate(json_prompts[:3], params)
    llm = LLM(str(zoo / "target"), speculative=_guided_tree(zoo), **kw)
    graphs = use_graphs(llm, capture=False, max_batch=8)
    outs = llm.generate(json_prompts[:3], params)
    assert graphs.num_runs > 2 and any(key[2] for key in graphs.captured), "guided tree steps took the padded layout"
    _check_guided(outs, plain, schemas)
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager]
    assert [o.metrics.accepted_lengths for o in outs] == [o.metrics.accepted_lengths for o in eager]
    assert sum(sum(o.metrics.accepted_lengths) - len(o.metrics.accepted_lengths) for o in outs) > 0
    assert llm.engine.blocks.pool.num_used == 0 and not llm.engine.guided.grammar.states


@pytest.mark.gpu
def test_cuda_graph_tree_replay_equals_eager(zoo, json_prompts):
    """On CUDA: the captured tree step, replayed for padded batch sizes 1, 4 and 8, gives the tokens and the
    acceptance of the same padded step run eagerly (the same kernels: bit for bit), greedy and seeded sampled, and
    its greedy requests the tokens of the engine without speculation."""
    params = _params(5)
    kw = dict(device="cuda", dtype="float32", num_kv_blocks=1024, block_size=16, max_num_seqs=8)
    plain = LLM(str(zoo / "target"), cuda_graphs=False, **kw)
    eager = LLM(str(zoo / "target"), speculative=_tree(zoo), cuda_graphs=False, **kw)
    use_graphs(eager, capture=False, max_batch=8)
    llm = LLM(str(zoo / "target"), speculative=_tree(zoo), **kw)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.capture
    for n in (1, 3, 5):  # the acceptance table learns across runs: the eager engine runs the same sequence
        outs = llm.generate(json_prompts[:n], params[:n])
        eager_outs = eager.generate(json_prompts[:n], params[:n])
        assert [o.token_ids for o in outs] == [o.token_ids for o in eager_outs]
        assert [o.metrics.accepted_lengths for o in outs] == [o.metrics.accepted_lengths for o in eager_outs]
        greedy = [i for i in range(n) if params[i].temperature == 0]
        ref = plain.generate([json_prompts[i] for i in greedy], [params[i] for i in greedy])
        assert [outs[i].token_ids for i in greedy] == [o.token_ids for o in ref]
    assert graphs.num_runs > 2 and any(graphs.captured.values())
    assert llm.engine.blocks.pool.num_used == 0


@pytest.mark.gpu
def test_cuda_graph_guided_tree_replay_equals_eager(zoo, json_prompts):
    """On CUDA: a guided tree batch replays a captured graph whose grammar fills are host functions (the parents and
    paths staged through pinned buffers), for many steps: tokens and acceptance equal the same padded step run
    eagerly, every token equals the guided engine without speculation, and finished outputs validate."""
    schemas, params = _guided(5)
    kw = dict(device="cuda", dtype="float32", num_kv_blocks=1024, block_size=16, max_num_seqs=8)
    plain = LLM(str(zoo / "target"), cuda_graphs=False, **kw).generate(json_prompts, params)
    eager = LLM(str(zoo / "target"), speculative=_guided_tree(zoo), cuda_graphs=False, **kw)
    use_graphs(eager, capture=False, max_batch=8)
    eager_outs = eager.generate(json_prompts, params)
    llm = LLM(str(zoo / "target"), speculative=_guided_tree(zoo), **kw)
    outs = llm.generate(json_prompts, params)
    graphs = llm.engine.runner.graphs
    masked = [cuda for key, cuda in graphs.captured.items() if key[2]]
    assert masked and all(masked), "guided tree steps replayed captured graphs"
    assert graphs.num_runs > 10
    _check_guided(outs, plain, schemas)
    assert [o.metrics.accepted_lengths for o in outs] == [o.metrics.accepted_lengths for o in eager_outs]
    assert llm.engine.blocks.pool.num_used == 0


def test_padding_rows_move_kv_only_inside_the_scratch_block(zoo):
    """A tree engine's cache holds one block past the pool's (a chain's none), and a padded step's padding rows
    (KV slot -1) compact within it: a batch of padding only (a capture's warm-up) touches no block a request holds,
    not even one a hand-over is being written into on another thread meanwhile."""
    import torch

    from kernels.tree_accept import _to_scratch, accept_path_ref, accept_path_triton

    tree = LLM(str(zoo / "target"), num_kv_blocks=64, block_size=16, speculative=_tree(zoo)).engine
    chain = LLM(str(zoo / "target"), num_kv_blocks=64, block_size=16,
                speculative=SpecConfig(method="mtp", k=3, draft=str(zoo / "mtp"))).engine
    assert (tree.kv_cache.shape[2], tree.stats()["kv_blocks_total"]) == (65, 64)
    assert chain.kv_cache.shape[2] == chain.stats()["kv_blocks_total"] == 64
    cache = torch.randn(2, 2, 5, 4, 1, 3)  # [L, planes, 4 pool blocks + the scratch one, block size 4, heads, D]
    pool = cache[:, :, :4].clone()
    assert _to_scratch(torch.full((6,), -1), cache).tolist() == [16] * 6  # the scratch block's first slot
    # two padding requests of 3 rows; the reference moves within the scratch block, the kernel (interpreted) skips them
    for accept_path in (accept_path_ref, accept_path_triton):
        accept_path(cache, torch.full((6,), -1), torch.tensor([[0, 1, 2], [3, 4, 5]]), torch.tensor([[0, 2, 2]] * 2),
                    torch.tensor([1, 1]), torch.zeros(6, dtype=torch.int64), torch.zeros((2, 3), dtype=torch.int64),
                    torch.tensor([False, False]))
        assert torch.equal(cache[:, :, :4], pool)
