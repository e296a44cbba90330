"""engine/models/qwen3_moe.py against transformers' Qwen3MoeForCausalLM on tiny random checkpoints (fp32): logits
for prefill, chunked prefill and decode steps, greedy generation token for token, and which layers are MoE."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.core.request import Request
from engine.core.scheduler import ScheduledRequest
from engine.layers.attention import attention_context
from engine.layers.moe import MoEBlock
from engine.models.llama import LlamaMLP
from engine.runner.batch import build_batch
from tests.support.qwen3_moe import VARIANTS, make_qwen3_moe_checkpoint

PROMPT = [0, 17, 43, 99, 5, 250, 31, 7, 300, 12, 64, 128, 3, 77, 201]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, one_thread_module):
    root = tmp_path_factory.mktemp("qwen3_moe")
    return {v: (str(root / v), make_qwen3_moe_checkpoint(root / v, v, seed=i)) for i, v in enumerate(VARIANTS)}


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


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(checkpoints, variant):
    path, hf = checkpoints[variant]
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=64, block_size=4))
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    for chunks in ([15], [5, 7, 3], [11, 1, 1, 1, 1], [1] * 15):
        torch.testing.assert_close(engine_logits(engine, PROMPT, chunks), ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_generation_matches_transformers(checkpoints, variant):
    path, hf = checkpoints[variant]
    prompts = [PROMPT, PROMPT[:4], PROMPT[3:12]]
    outs = LLM(path, num_kv_blocks=64, block_size=4).generate(
        prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    hf.generation_config.eos_token_id = None
    for prompt, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=20, do_sample=False)[0, len(prompt):].tolist()
        assert out.token_ids == ref


def test_moe_layers_follow_sparse_step_and_mlp_only_layers(checkpoints):
    kinds = {}
    for variant, (path, _) in checkpoints.items():
        model = LLMEngine(EngineConfig(model=path, num_kv_blocks=8)).runner.model
        kinds[variant] = [type(layer.mlp) for layer in model.layers]
    assert kinds["norm_topk"] == [MoEBlock, LlamaMLP, MoEBlock]  # mlp_only_layers [1]
    assert kinds["sparse_step"] == [LlamaMLP, MoEBlock, LlamaMLP]  # (i + 1) % 2 == 0
