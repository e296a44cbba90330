"""engine/models/deepseek_v3.py against transformers' DeepseekV3ForCausalLM on tiny random checkpoints (fp32):
logits for prefill, chunked prefill and decode steps (absorbed latent attention against transformers' expanded
form), greedy generation token for token, the latent cache's size, and how the family meets the engine
(speculation by prompt lookup, the graph layout, prefix caching, typed errors)."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, EngineConfig, LLMEngine, SamplingParams, SpecConfig
from engine.core.request import Request
from engine.core.scheduler import ScheduledRequest
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.layers.attention import attention_context
from engine.runner.batch import build_batch
from tests.support.deepseek import VARIANTS, deepseek_config, make_deepseek_checkpoint
from tests.support.spec import use_graphs

PROMPT = [0, 17, 43, 99, 5, 250, 31, 7, 300, 12, 64, 128, 3, 77, 201]
PROMPTS = [PROMPT, PROMPT[:4], PROMPT[3:12]]
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, one_thread_module):
    """variant -> (model dir, transformers model)."""
    root = tmp_path_factory.mktemp("deepseek")
    return {v: (str(root / v), make_deepseek_checkpoint(root / v, v, seed=i)) for i, v in enumerate(VARIANTS)}


@pytest.fixture(scope="module")
def engines(checkpoints):
    return {v: LLMEngine(EngineConfig(model=path, num_kv_blocks=64, block_size=4)) for v, (path, _) in checkpoints.items()}


def engine_logits(engine: LLMEngine, tokens: list[int], chunks: list[int]) -> torch.Tensor:
    """Run `tokens` through the engine's model in the given chunk sizes; logits for every position [len, V]."""
    req = Request("r", tokens, SamplingParams(), seed=0, max_total_tokens=engine.max_model_len)
    out = []
    for n in chunks:
        assert engine.blocks.allocate("r", req.num_computed_tokens + n)
        inputs = build_batch([ScheduledRequest(req, n, sample=False)], engine.blocks, engine.kv_cache,
                             engine.runner.device, engine.model_cfg.vocab_size, 0, None)
        with torch.inference_mode(), attention_context(inputs.attn):
            hidden, _ = engine.runner.model(inputs.input_ids, inputs.positions)
            out.append(engine.runner.model.compute_logits(hidden))
        req.num_computed_tokens += n
    engine.blocks.free("r")
    return torch.cat(out)


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    hf.generation_config.eos_token_id = None  # both sides run through EOS (ignore_eos)
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("chunks", [[15], [5, 7, 3], [11, 1, 1, 1, 1], [1] * 15],
                         ids=["prefill", "chunked", "decode", "all-decode"])
def test_logits_match_transformers(checkpoints, engines, variant, chunks):
    _, hf = checkpoints[variant]
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    got = engine_logits(engines[variant], PROMPT, chunks)
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_generation_matches_transformers(checkpoints, variant):
    """Three prompts batched through the LLM API, twice: the second round reads the first's prompt blocks
    from the prefix cache."""
    path, hf = checkpoints[variant]
    llm = LLM(path, num_kv_blocks=64, block_size=4)
    refs = [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    for _ in range(2):
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == refs
        assert all(o.finish_reason == "length" for o in outs)


def test_latent_cache_holds_latent_and_rope_key_only(engines):
    """Per token per layer the cache holds kv_lora_rank + qk_rope_head_dim elements (no per-head K and V), and
    the runner sizes blocks by it."""
    engine = engines["q_lora"]
    mla = engine.model_cfg.mla
    width = mla.kv_lora_rank + mla.qk_rope_head_dim  # 32 + 8
    runner, layers, bs = engine.runner, engine.model_cfg.num_layers, engine.cfg.block_size
    assert runner.kv_spec.elements_per_token() == width
    assert runner.kv_spec.bytes_per_token(torch.float32) == width * 4
    assert engine.kv_cache.shape == (layers, 1, 64, bs, 1, width)
    assert runner.kv_block_bytes() == layers * bs * width * 4
    assert engine.kv_cache[0].numel() // (64 * bs) == width
    # what the expanded form would cache instead: K (nope + rope) and V per head
    expanded = engine.model_cfg.num_heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim)
    assert expanded > 3 * width


def test_prompt_lookup_speculation_is_lossless(checkpoints):
    """Verification chains of k+1 rows attend over the latent cache like any other rows: greedy output with
    prompt lookup (k = 3) equals the output without speculation, and some drafts are accepted."""
    path, _ = checkpoints["no_q_lora"]
    repetitive = PROMPT[:6] * 3
    plain = LLM(path, num_kv_blocks=64, block_size=4).generate([repetitive, PROMPT], GREEDY)
    llm = LLM(path, num_kv_blocks=64, block_size=4, speculative=SpecConfig(method="ngram", k=3))
    spec = llm.generate([repetitive, PROMPT], GREEDY)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(llm.engine.spec_stats.accepted_length_hist[2:]) > 0, "no step accepted a draft"


def test_graph_layout_matches_eager(checkpoints):
    """The padded step layout captured graphs replay (run eagerly here) gives the same tokens."""
    path, hf = checkpoints["q_lora"]
    llm = LLM(path, num_kv_blocks=64, block_size=4)
    graphs = use_graphs(llm, capture=False)
    outs = llm.generate(PROMPTS, GREEDY)
    assert graphs.num_runs > 0
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]


def test_bf16_sharded_checkpoint(tmp_path):
    """A bf16 checkpoint split over several safetensors shards loads as bf16 except the routers (gate weight,
    correction bias), which score in fp32 as transformers keeps them; the cache is bf16, one latent row per token;
    the logits follow transformers' bf16 model."""
    hf = make_deepseek_checkpoint(tmp_path, "q_lora", seed=5, dtype=torch.bfloat16, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    engine = LLMEngine(EngineConfig(model=str(tmp_path), num_kv_blocks=16, block_size=4))
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    got = engine_logits(engine, PROMPT, [9, 6])
    torch.testing.assert_close(got.softmax(-1), ref.softmax(-1), atol=2e-2, rtol=0)
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.5
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])
    model = engine.runner.model
    assert engine.runner.dtype == torch.bfloat16 and engine.kv_cache.dtype == torch.bfloat16
    gate = model.layers[1].mlp.gate
    assert gate.weight.dtype == torch.float32 and gate.e_score_correction_bias.dtype == torch.float32
    assert model.layers[1].mlp.experts.w13.dtype == torch.bfloat16
    out = LLM(str(tmp_path), num_kv_blocks=16, block_size=4).generate([PROMPT], GREEDY)[0]
    assert len(out.token_ids) == GREEDY.max_tokens


def test_missing_expert_weight_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    make_deepseek_checkpoint(tmp_path, "q_lora", seed=6)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight"):
        LLMEngine(EngineConfig(model=str(tmp_path), num_kv_blocks=8))


def test_draft_networks_are_refused_for_mla_targets(checkpoints):
    path, _ = checkpoints["q_lora"]
    with pytest.raises(UnsupportedModelError, match="not built for MLA"):
        LLMEngine(EngineConfig(model=path, num_kv_blocks=8, speculative=SpecConfig(method="draft_model", k=1,
                                                                                   draft=path)))


def test_config_reads_the_family(checkpoints):
    from engine.config import ModelConfig

    cfg = ModelConfig.from_dir(checkpoints["no_q_lora"][0])
    want = deepseek_config("no_q_lora")
    assert cfg.family == "deepseek_v3" and cfg.mla.q_lora_rank is None and cfg.num_kv_heads == 1
    assert cfg.head_dim == want.kv_lora_rank + want.qk_rope_head_dim
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.n_group, cfg.moe.topk_group) == (8, 3, 4, 2)
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["mscale_all_dim"] == 0.8


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cuda_matches_transformers(checkpoints, variant):
    """On CUDA in fp32: the Triton latent kernels, the experts' CUDA path and the captured decode graphs give
    transformers' logits (prefill, chunked, decode) and its greedy tokens."""
    path, hf = checkpoints[variant]
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    engine = LLMEngine(EngineConfig(model=path, device="cuda", num_kv_blocks=64, block_size=4))
    for chunks in ([15], [5, 7, 3], [11, 1, 1, 1, 1]):
        torch.testing.assert_close(engine_logits(engine, PROMPT, chunks).cpu(), ref, atol=1e-3, rtol=1e-3)
    llm = LLM(path, device="cuda", num_kv_blocks=64, block_size=4)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.num_runs > 0


@pytest.mark.gpu
def test_cuda_bf16(checkpoints):
    """bf16 on CUDA (the experts' grouped GEMMs): distributions close to transformers' fp32, argmax equal where
    it is clear-cut, and a graph-replayed generation."""
    path, hf = checkpoints["q_lora"]
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    engine = LLMEngine(EngineConfig(model=path, device="cuda", dtype="bfloat16", num_kv_blocks=64, block_size=4))
    got = engine_logits(engine, PROMPT, [9, 1, 1, 1, 1, 1, 1]).cpu()
    torch.testing.assert_close(got.softmax(-1), ref.softmax(-1), atol=3e-2, rtol=0)
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.5
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])
    llm = LLM(path, device="cuda", dtype="bfloat16", num_kv_blocks=64, block_size=4)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in llm.generate(PROMPTS, GREEDY))
    assert llm.engine.runner.graphs.num_runs > 0


def test_fp8_checkpoint_is_refused(tmp_path):
    """The published DeepSeek-V3 weights are FP8 blocks with scales (quantization_config): refused with a typed
    error rather than loaded as if the values were plain floats."""
    import json

    make_deepseek_checkpoint(tmp_path, "q_lora", seed=8)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                  "activation_scheme": "dynamic"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="fp8"):
        LLMEngine(EngineConfig(model=str(tmp_path), num_kv_blocks=8))
