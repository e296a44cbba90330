"""engine/models/deepseek_mtp.py: DeepSeek-V3's own MTP layer, read from the target's checkpoint, against a
plain-torch reference of its formula (transformers builds no MTP module; its decoder layer is the block), and
MTP speculation through the engine lossless against no speculation and against transformers."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, EngineConfig, LLMEngine, SamplingParams, SpecConfig
from engine.errors import ModelLoadError
from engine.models.deepseek_mtp import DeepseekMTPHead
from tests.support.deepseek import add_mtp_layer, make_deepseek_checkpoint, mtp_logits_over_prompt

PROMPT = [0, 17, 43, 99, 5, 250, 31, 7, 300, 12, 64, 128, 3, 77, 201]
PROMPTS = [PROMPT, PROMPT[:4], PROMPT[3:12] * 2]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, one_thread_module):
    """(dir, transformers target, the MTP layer's tensors): a q_lora target with its MTP layer beside it."""
    path = tmp_path_factory.mktemp("deepseek_mtp")
    hf = make_deepseek_checkpoint(path, "q_lora", seed=11)
    return str(path), hf, add_mtp_layer(path, hf, seed=12)


def reference_mtp_logits(hf, mtp: dict[str, torch.Tensor], tokens: list[int]) -> torch.Tensor:
    """Draft logits at indices 0..n-2 (each predicting token i+2), by the formula: eh_proj of [enorm(embed(t[i+1])),
    hnorm(final hidden[i])], transformers' decoder layer (causal over the layer's own inputs), shared head."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    cfg, n = hf.config, hf.config.num_hidden_layers
    w = {k.removeprefix(f"model.layers.{n}."): v for k, v in mtp.items()}
    block = DeepseekV3DecoderLayer(cfg, layer_idx=n).eval()
    state = {k: v for k, v in w.items() if k.split(".")[0] in ("self_attn", "mlp", "input_layernorm",
                                                               "post_attention_layernorm") and ".experts." not in k}
    inter = cfg.moe_intermediate_size
    state["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([w[f"mlp.experts.{e}.gate_proj.weight"],
                                                                w[f"mlp.experts.{e}.up_proj.weight"]])
                                                     for e in range(cfg.n_routed_experts)])
    state["mlp.experts.down_proj"] = torch.stack([w[f"mlp.experts.{e}.down_proj.weight"] for e in range(cfg.n_routed_experts)])
    assert state["mlp.experts.gate_up_proj"].shape[1] == 2 * inter
    block.load_state_dict(state)

    def rms(x, weight):
        return F.rms_norm(x, (x.shape[-1],), weight, cfg.rms_norm_eps)

    ids = torch.tensor([tokens])
    with torch.no_grad():
        hidden = hf.model(ids).last_hidden_state[0, :-1]  # after the final norm: what the LM head reads
        emb = F.embedding(ids[0, 1:], w["embed_tokens.weight"])
        x = torch.cat([rms(emb, w["enorm.weight"]), rms(hidden, w["hnorm.weight"])], -1) @ w["eh_proj.weight"].T
        m = x.shape[0]
        pos = torch.arange(m)[None]
        mask = torch.full((m, m), float("-inf")).triu(1)[None, None]
        y = block(x[None], attention_mask=mask, position_ids=pos, position_embeddings=hf.model.rotary_emb(x, pos))
        return rms(y[0], w["shared_head.norm.weight"]) @ w["shared_head.head.weight"].T


def test_mtp_layer_matches_its_formula(checkpoint):
    """The head over a prompt's rows (the first chain step of a prefill), reading the target's final hidden states
    and writing its latent rows into the cache layer after the target's."""
    path, hf, mtp = checkpoint
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=64, block_size=4, speculative=SpecConfig("mtp", k=1)))
    head = engine.runner.proposer.head
    assert isinstance(head, DeepseekMTPHead) and engine.kv_cache.shape[0] == hf.config.num_hidden_layers + 1
    got = mtp_logits_over_prompt(engine, PROMPT)
    torch.testing.assert_close(got, reference_mtp_logits(hf, mtp, PROMPT), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_speculation_is_lossless(checkpoint, k):
    """Greedy and seeded sampling with the checkpoint's own MTP layer drafting k tokens equal the output without
    speculation (and greedy equals transformers)."""
    path, hf, _ = checkpoint
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=16, temperature=0.8, seed=5, ignore_eos=True)
    plain = LLM(path, num_kv_blocks=96, block_size=4)
    spec = LLM(path, num_kv_blocks=96, block_size=4, speculative=SpecConfig(method="mtp", k=k))
    for params in (greedy, seeded):
        want = [o.token_ids for o in plain.generate(PROMPTS, params)]
        assert [o.token_ids for o in spec.generate(PROMPTS, params)] == want
    hist = spec.engine.spec_stats.accepted_length_hist
    assert sum(hist[1:]) > 0, "no decoding step verified drafts"
    hf.generation_config.eos_token_id = None
    ref = hf.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
                      max_new_tokens=16, do_sample=False)[0, len(PROMPT):].tolist()
    assert spec.generate([PROMPT], greedy)[0].token_ids == ref


def test_handover_moves_the_latent_cache_and_its_mtp_layer(checkpoint):
    """Prefill-only on one engine, its blocks packed by the hand-over's kernels (one plane: the whole latent row of
    kv_lora_rank + qk_rope_head_dim, the MTP layer's after the target's) and unpacked into another engine: the
    decode engine's first step verifies k drafts and its tokens equal one engine's. A hand-over whose cache row is
    K and V heads is refused before any KV moves."""
    import dataclasses

    from cluster.protocol import KVLayout
    from engine import HandoverRequest, InvalidRequestError
    from kernels.kv_transfer import pack_kv, unpack_kv

    path, _, _ = checkpoint
    spec, greedy = SpecConfig(method="mtp", k=2), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prefill = LLMEngine(EngineConfig(model=path, num_kv_blocks=32, block_size=4, speculative=spec))
    decode = LLMEngine(EngineConfig(model=path, num_kv_blocks=48, block_size=4, speculative=spec))
    prefill.add_request("r", PROMPT, greedy, prefill_only=True)
    while prefill.requests["r"].status.value != "parked":
        prefill.step()
    h = prefill.take_handover("r")
    width = prefill.model_cfg.mla.cache_width
    # What a served decode group states of its cache (cluster/protocol/decode.py), here for the prefill engine.
    assert KVLayout.of(prefill) == KVLayout(num_layers=4, planes=1, num_kv_heads=1, head_dim=width, replicated=True,
                                            block_size=4, dtype="float32")
    assert (h.request.cache_layers, h.request.cache_planes, h.request.cache_head_dim) == (4, 1, width) == (4, 1, 40)
    buffer = pack_kv(prefill.kv_cache, torch.tensor(h.payload_block_ids))
    assert buffer.shape == (4, 1, len(h.payload_block_ids), 4, 1, width)
    blocks = decode.reserve(HandoverRequest.from_dict(h.request.to_dict()))  # through its wire form
    unpack_kv(buffer, decode.kv_cache, torch.tensor(blocks))
    prefill.release("r")
    decode.commit("r", drafts=h.drafts)
    outs = decode.step()
    assert decode.requests["r"].metrics.num_draft_tokens == 2  # the prefill step's drafts, verified at once
    while decode.has_unfinished():
        outs += decode.step()
    want = LLM(path, num_kv_blocks=48, block_size=4).generate([PROMPT], greedy)[0].token_ids
    assert outs[-1].finished and outs[-1].token_ids == want
    heads = dataclasses.replace(h.request, request_id="kv-heads", cache_planes=2, cache_head_dim=16)
    with pytest.raises(InvalidRequestError, match="2 plane"):
        decode.reserve(heads)
    assert prefill.stats()["kv_blocks_used"] == decode.stats()["kv_blocks_used"] == 0


def test_checkpoint_without_mtp_layer_is_named(tmp_path):
    make_deepseek_checkpoint(tmp_path, "no_q_lora", seed=13)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.3\.\*"):
        LLMEngine(EngineConfig(model=str(tmp_path), num_kv_blocks=8, speculative=SpecConfig("mtp", k=1)))
