"""Draft trees on an MLA target (DeepSeek-V3 family) drafting with its own MTP layer: the zoo's tiny-moe. The target's
verification rows and the MTP layer's expansion rows attend through latent paged attention with the tree mask, and
the accepted path's latent rows are compacted like a dense cache's K and V. Outputs equal the engine without
speculation: greedy trees of several widths and sizes, a guided request and a seeded sampled one beside them."""
from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams, SpecConfig, StructuredOutput
from engine.layers.attention import AttentionMetadata, attention_context
from engine.layers.latent_attention import LatentPagedAttention
from kernels.tree_accept import accept_path_ref, accept_path_triton
from kernels.mla_attention import mla_attention_ref

from tests.support.paged_batches import latent_batch as make_batch
from tests.support.paged_batches import tree_case

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string"}},
          "required": ["id", "name"]}


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread_module):
    """Tiny models: one intra-op thread (tests/engine/conftest.py)."""


@pytest.fixture(scope="module")
def target() -> str:
    from zoo.models import resolve

    return str(resolve("tandem-tiny-moe").target)  # its MTP layer sits in the same directory (mtp.safetensors)


@pytest.fixture(scope="module")
def requests():
    """Three greedy requests, a guided greedy one and a seeded sampled one."""
    from zoo.corpus import heldout_cases
    from zoo.prompts import json_schema_prompt

    prompts = [json_schema_prompt(row["schema"]) for row in heldout_cases()[:4]]
    prompts.append(prompts[1])
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True) for _ in range(3)]
    params.append(SamplingParams(max_tokens=32, temperature=0,
                                 structured_output=StructuredOutput(json_schema=json.dumps(SCHEMA))))
    params.append(SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True))
    return prompts, params


@pytest.fixture(scope="module")
def reference(target, requests):
    return [o.token_ids for o in LLM(target, num_kv_blocks=256, block_size=16).generate(*requests)]


@pytest.mark.parametrize("topk,depth,nodes", [(2, 2, 3), (2, 3, 6), (3, 3, 7), (3, 4, 12)])
def test_mla_tree_equals_no_speculation(target, requests, reference, topk, depth, nodes):
    """Every step after the first continues from latent KV the previous step compacted; the guided request's
    trees are masked at expansion and verification; every block is free afterwards and trees accept drafts."""
    spec = SpecConfig(method="mtp", k=depth, topk=topk, num_verify_tokens=nodes)
    llm = LLM(target, num_kv_blocks=256, block_size=16, speculative=spec)
    outs = llm.generate(*requests)
    assert [o.token_ids for o in outs] == reference
    json.loads(outs[3].text)  # the guided request finished its object
    assert llm.engine.blocks.pool.num_used == 0
    assert llm.engine.stats()["spec"]["mean_accepted_length"] > 1.5


@pytest.mark.parametrize("triton", [False, True])
def test_latent_attention_takes_the_tree_mask(monkeypatch, triton):
    """LatentPagedAttention attends with the metadata's tree mask on both dispatch paths: the reference's step plan
    and the Triton kernel (the path of every row on a GPU; here forced onto the interpreter). The engine tests above
    run the reference only, whose plan reads the mask from the metadata."""
    if triton:
        for module in ("engine.layers.latent_attention", "kernels.mla_attention"):
            monkeypatch.setattr(f"{module}.use_triton", lambda t: True)
    q_lens, seq_lens, H, L, R = [5, 1, 7], [40, 9, 7], 4, 32, 16
    batch, _ = make_batch(q_lens, seq_lens, H, L, R, 8, torch.float32, seed=5)
    tree, _ = tree_case(q_lens, seq_lens, 5)
    T = sum(q_lens)
    cache = batch["latent_cache"]
    meta = AttentionMetadata(kv_cache=cache.view(1, 1, *cache.shape[:2], 1, cache.shape[2]),
                             slot_mapping=torch.full((T,), -1, dtype=torch.int64),  # the rows are already cached
                             block_tables=batch["block_tables"], seq_lens=batch["seq_lens"],
                             query_start_loc=batch["query_start_loc"], max_q_len=7, max_seq_len=40, tree_mask=tree)
    layer = LatentPagedAttention(0, H, L, R, 0.2)
    with attention_context(meta):
        got = layer(batch["q_latent"], batch["q_rope"], torch.zeros(T, L), torch.zeros(T, R))
    kw = dict(scale=0.2, max_q_len=7, max_seq_len=40)
    torch.testing.assert_close(got, mla_attention_ref(**batch, **kw, tree_mask=tree), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, mla_attention_ref(**batch, **kw), atol=1e-3)


@pytest.mark.parametrize("accept_path", [accept_path_ref, accept_path_triton])
def test_accepted_path_moves_latent_rows(accept_path):
    """The latent cache [L, 1, N, S, 1, kv_lora_rank + rope]: the accepted nodes' whole rows (every layer) land at
    the positions after the root; other slots keep theirs (the reference and the kernel, interpreted)."""
    cache = torch.arange(3 * 4 * 4 * 6, dtype=torch.float32).view(3, 1, 4, 4, 1, 6)
    slot_mapping = torch.tensor([2, 3, 4, 5, 9, 10, 11])  # request 0: root and 3 nodes; request 1: root and 2
    vr = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 6]])
    path = torch.tensor([[0, 3, 3], [0, 2, 2]])  # request 0 accepts node 3 only, request 1 node 2 only
    before = cache.clone()
    accept_path(cache, slot_mapping, vr, path, torch.tensor([1, 1]), torch.zeros(7, dtype=torch.int64),
                torch.zeros((2, 3), dtype=torch.int64), torch.tensor([False, False]))
    flat, old = cache.view(3, 16, 6), before.view(3, 16, 6)
    assert torch.equal(flat[:, 3], old[:, 5]) and torch.equal(flat[:, 10], old[:, 11])
    keep = [s for s in range(16) if s not in (3, 10)]
    assert torch.equal(flat[:, keep], old[:, keep])
