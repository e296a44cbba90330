"""engine/layers/moe.py: the router against transformers' DeepSeek-V3 router, the batched experts against a
per-token loop, tensor-parallel shards summing to the whole, and the block against transformers' MoE."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config_mla import MoEConfig
from engine.distributed.parallel import TPContext
from engine.errors import ModelLoadError
from engine.layers.moe import EXPERT_PARTS, MoEBlock, RoutedExperts, TopKRouter

H, I, E = 24, 16, 8
MOE = MoEConfig(num_experts=E, top_k=3, intermediate_size=I, num_shared_experts=1, first_dense_layers=0, n_group=4,
                topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, scoring="sigmoid")


def hf_config(moe: MoEConfig):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(hidden_size=H, moe_intermediate_size=moe.intermediate_size, n_routed_experts=moe.num_experts,
                            num_experts_per_tok=moe.top_k, n_group=moe.n_group, topk_group=moe.topk_group,
                            routed_scaling_factor=moe.routed_scaling_factor, norm_topk_prob=moe.norm_topk_prob,
                            n_shared_experts=moe.num_shared_experts)


def expert_weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return {(e, p): torch.randn((H, I) if p == 2 else (I, H), generator=g) for e in range(E) for p in range(3)}


def loaded_experts(weights, tp: TPContext = TPContext()) -> RoutedExperts:
    experts = RoutedExperts(H, I, E, tp)
    for (e, p), w in weights.items():
        experts.load(f"experts.{e}.{EXPERT_PARTS[p]}.weight", w, (e, p))
    return experts


def per_token_reference(x, weights, ids, w):
    """Each token through each of its chosen experts, one at a time."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            h = torch.nn.functional.silu(x[t] @ w[(e, 0)].T) * (x[t] @ w[(e, 1)].T)
            out[t] += weights[t, k] * (h @ w[(e, 2)].T)
    return out


@pytest.mark.parametrize("n_group,topk_group", [(4, 2), (1, 1), (2, 1), (2, 2)])
@pytest.mark.parametrize("norm", [True, False])
def test_router_matches_transformers(n_group, topk_group, norm):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    moe = dataclasses.replace(MOE, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm)
    hf = DeepseekV3TopkRouter(hf_config(moe))
    g = torch.Generator().manual_seed(n_group * 10 + topk_group)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(E, H, generator=g))
        hf.e_score_correction_bias.copy_(torch.rand(E, generator=g))  # transformers starts it at zero
    ours = TopKRouter(H, moe)
    ours.load("gate.weight", hf.weight.detach(), None)
    ours.load("gate.e_score_correction_bias", hf.e_score_correction_bias, None)
    x = torch.randn(37, H, generator=g)
    _, ref_w, ref_ids = hf(x)
    w, ids = ours(x)
    order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(w.gather(1, order), ref_w.gather(1, ref_order))


def test_correction_bias_steers_choice_not_weights():
    """A large bias on one expert makes every token choose it, with its weight still from the plain score."""
    router = TopKRouter(H, dataclasses.replace(MOE, n_group=1, topk_group=1, norm_topk_prob=False))
    router.load("gate.weight", torch.randn(E, H), None)
    bias = torch.zeros(E)
    bias[5] = 100.0
    router.load("gate.e_score_correction_bias", bias, None)
    x = torch.randn(9, H)
    w, ids = router(x)
    assert bool((ids == 5).any(-1).all())
    plain = torch.sigmoid(x @ router.weight.T)[:, 5] * MOE.routed_scaling_factor
    torch.testing.assert_close(w[ids == 5], plain)


@pytest.mark.parametrize("form", ["_grouped", "_gathered"])
@pytest.mark.parametrize("T", [0, 1, 3, 40])
@pytest.mark.parametrize("routing", ["random", "one_expert", "skewed"])
def test_batched_experts_match_per_token_loop(form, T, routing):
    """Both batched forms (grouped GEMMs over sorted pairs; gathered weights) against one token at a time,
    with experts left unused and one expert taking every token."""
    w = expert_weights()
    experts = loaded_experts(w)
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, H, generator=g)
    if routing == "random":
        ids = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(T)]) if T else torch.zeros(0, 3, dtype=torch.long)
    elif routing == "one_expert":  # duplicates are impossible from top-k, but one expert may take every token
        ids = torch.stack([torch.tensor([6, 0, 3])] * T) if T else torch.zeros(0, 3, dtype=torch.long)
    else:
        ids = torch.randint(0, 2, (T, 3), generator=g) * 7
    weights = torch.rand(T, 3, generator=g)
    got = getattr(experts, form)(x, weights, ids)
    torch.testing.assert_close(got, per_token_reference(x, weights, ids, w), atol=1e-4, rtol=1e-5)


def test_gathered_form_in_chunks(monkeypatch):
    """The gathered form under a small memory bound: pairs in chunks of 2 experts' weights, the same sums."""
    import engine.layers.moe as moe

    w = expert_weights(2)
    experts = loaded_experts(w)
    monkeypatch.setattr(moe, "GATHER_BYTES", 2 * experts.w13[0].numel() * experts.w13.element_size())
    x, weights = torch.randn(7, H), torch.rand(7, 3)
    ids = torch.stack([torch.randperm(E)[:3] for _ in range(7)])
    torch.testing.assert_close(experts._gathered(x, weights, ids), per_token_reference(x, weights, ids, w),
                               atol=1e-4, rtol=1e-5)


def test_tensor_parallel_shards_sum_to_the_whole():
    """Each rank holds a slice of every expert's intermediate dim; the shards' partial outputs sum to the
    unsharded experts' (the block all-reduces them)."""
    w = expert_weights(1)
    x, weights = torch.randn(11, H), torch.rand(11, 3)
    ids = torch.stack([torch.randperm(E)[:3] for _ in range(11)])
    whole = loaded_experts(w)(x, weights, ids)
    parts = [loaded_experts(w, TPContext(r, 2, group=object()))(x, weights, ids) for r in range(2)]
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("form", ["_grouped", "_gathered"])
@pytest.mark.parametrize("ranks, T", [(2, 11), (4, 5), (2, 0)])
def test_expert_parallel_shards_sum_to_the_whole(form, ranks, T):
    """Expert parallelism: each rank loads only its E / N experts, whole, and computes only the pairs routed to
    them (the rest sort past its last group, or read weight 0 in the gathered form); the shards' outputs sum to
    the unsharded experts' (the block's one reduction). Routing that leaves one rank with no pair at all too."""
    w = expert_weights(3)
    g = torch.Generator().manual_seed(ranks * 100 + T)
    x, weights = torch.randn(T, H, generator=g), torch.rand(T, 3, generator=g)
    ids = (torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(T)]) if T
           else torch.zeros(0, 3, dtype=torch.long))
    whole = loaded_experts(w)._gathered(x, weights, ids)
    shards = [loaded_experts(w, TPContext(r, ranks, group=object(), expert_parallel=True)) for r in range(ranks)]
    per = E // ranks
    for r, shard in enumerate(shards):  # its own experts, whole
        assert shard.w13.shape == (per, 2 * I, H) and shard.first_expert == r * per
        torch.testing.assert_close(shard.w2[0], w[(r * per, 2)])
    torch.testing.assert_close(sum(getattr(s, form)(x, weights, ids) for s in shards), whole, atol=1e-4, rtol=1e-5)
    if T:  # every pair on rank 0's experts: the other ranks add exactly nothing
        low = ids % per
        assert all(getattr(s, form)(x, weights, low).eq(0).all() for s in shards[1:])


def test_expert_parallel_needs_experts_divisible_by_ranks():
    with pytest.raises(ValueError, match="n_routed_experts=8 is not divisible by tp_size=3"):
        RoutedExperts(H, I, E, TPContext(0, 3, group=object(), expert_parallel=True))


def test_expert_load_errors():
    experts = RoutedExperts(H, I, E, TPContext())
    with pytest.raises(ModelLoadError, match="expert 8"):
        experts.load("experts.8.gate_proj.weight", torch.zeros(I, H), (8, 0))
    with pytest.raises(ModelLoadError, match="has shape"):
        experts.load("experts.1.down_proj.weight", torch.zeros(I, H), (1, 2))


def test_block_matches_transformers_moe():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    torch.manual_seed(3)
    hf = DeepseekV3MoE(hf_config(MOE)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_()
        hf.gate.e_score_correction_bias.uniform_(0, 0.5)
    block = MoEBlock(H, MOE, TPContext())
    sd = hf.state_dict()
    block.gate.load("gate.weight", sd["gate.weight"], None)
    block.gate.load("gate.e_score_correction_bias", sd["gate.e_score_correction_bias"], None)
    gate_up, down = sd["experts.gate_up_proj"], sd["experts.down_proj"]  # transformers' in-memory layout
    for e in range(E):
        for p, w in enumerate((gate_up[e, :I], gate_up[e, I:], down[e])):
            block.experts.load(f"experts.{e}.{EXPERT_PARTS[p]}.weight", w, (e, p))
    block.shared_experts.gate_up_proj.load("gate_proj.weight", sd["shared_experts.gate_proj.weight"], 0)
    block.shared_experts.gate_up_proj.load("up_proj.weight", sd["shared_experts.up_proj.weight"], 1)
    block.shared_experts.down_proj.load("down_proj.weight", sd["shared_experts.down_proj.weight"])
    x = torch.randn(1, 13, H)
    with torch.no_grad():
        ref = hf(x)[0]
    torch.testing.assert_close(block(x[0]), ref, atol=1e-4, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_on_cuda_capture_in_a_graph(dtype):
    """The experts' CUDA path (grouped GEMMs in bf16, gathered weights otherwise) matches the per-token loop,
    and replays from a captured CUDA graph with new routing (no host sync, no routing-dependent shape)."""
    w = expert_weights(4)
    experts = loaded_experts(w).to("cuda", dtype)
    x = torch.randn(16, H, device="cuda", dtype=dtype)
    ids = torch.stack([torch.randperm(E)[:3] for _ in range(16)]).cuda()
    weights = torch.rand(16, 3, device="cuda")
    wf = {key: v.to(dtype).float() for key, v in w.items()}
    scale = per_token_reference(x.float().cpu(), weights.cpu(), ids.cpu(), wf).abs().max().item()
    # bf16 rounds every intermediate: errors relative to the output's scale, not to each (possibly tiny) element
    tol = dict(atol=1e-3, rtol=1e-3) if dtype == torch.float32 else dict(atol=0.02 * scale, rtol=0)
    torch.testing.assert_close(experts(x, weights, ids).float().cpu(),
                               per_token_reference(x.float().cpu(), weights.cpu(), ids.cpu(), wf), **tol)
    experts(x, weights, ids)  # warm-up on the side stream is what capture needs
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = experts(x, weights, ids)
    ids.copy_(torch.stack([torch.randperm(E)[:3] for _ in range(16)]).cuda())
    ids[:8] = torch.tensor([1, 2, 3], device="cuda")  # one skewed half
    graph.replay()
    torch.testing.assert_close(out.float().cpu(), per_token_reference(x.float().cpu(), weights.cpu(), ids.cpu(), wf),
                               **tol)


@pytest.mark.parametrize("norm", [True, False])
def test_softmax_router_matches_qwen3_moe(norm):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    hf = Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=2, norm_topk_prob=norm))
    with torch.no_grad():
        hf.weight.normal_()
    moe = MoEConfig(num_experts=E, top_k=2, intermediate_size=I, num_shared_experts=0, first_dense_layers=0, n_group=1,
                    topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=norm, scoring="softmax")
    ours = TopKRouter(H, moe)
    ours.load("gate.weight", hf.weight.detach(), None)
    x = torch.randn(21, H)
    _, ref_w, ref_ids = hf(x)
    w, ids = ours(x)
    assert torch.equal(ids.sort(-1).values, ref_ids.sort(-1).values)
    torch.testing.assert_close(w.gather(1, ids.argsort(-1)), ref_w.gather(1, ref_ids.argsort(-1)))
