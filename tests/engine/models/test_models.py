"""engine/models/llama.py against transformers: logits for prefill, chunked prefill and decode steps,
and greedy generation token for token, for every supported architecture."""
from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, LLM, LLMEngine, SamplingParams
from engine.core.request import Request
from engine.core.scheduler import ScheduledRequest
from engine.layers.attention import attention_context
from engine.runner.batch import build_batch
from tests.support.checkpoints import ARCHS, make_checkpoint

PROMPT = [0, 17, 43, 99, 5, 250, 31, 7, 300, 12, 64, 128, 3, 77, 201]


def engine_logits(engine: LLMEngine, tokens: list[int], chunks: list[int]) -> torch.Tensor:
    """Run `tokens` through the engine in the given chunk sizes; logits for every position [len, V]."""
    req = Request("r", tokens, SamplingParams(), seed=0, max_total_tokens=engine.max_model_len)
    out = []
    for n in chunks:
        assert engine.blocks.allocate("r", req.num_computed_tokens + n)
        sched = [ScheduledRequest(req, n, sample=False)]
        inputs = build_batch(sched, engine.blocks, engine.kv_cache, engine.runner.device, engine.model_cfg.vocab_size,
                             0, None)
        with torch.inference_mode(), attention_context(inputs.attn):
            hidden, _ = engine.runner.model(inputs.input_ids, inputs.positions)
            out.append(engine.runner.model.compute_logits(hidden))
        req.num_computed_tokens += n
    engine.blocks.free("r")
    return torch.cat(out)


@pytest.fixture(scope="module")
def engines(checkpoints):
    return {arch: LLMEngine(EngineConfig(model=path, num_kv_blocks=64, block_size=4)) for arch, (path, _) in checkpoints.items()}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunks", [[15], [5, 7, 3], [15 - 4, 1, 1, 1, 1], [1] * 15], ids=["prefill", "chunked", "decode", "all-decode"])
def test_logits_match_transformers(checkpoints, engines, arch, chunks):
    _, hf = checkpoints[arch]
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    got = engine_logits(engines[arch], PROMPT, chunks)
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_matches_transformers(checkpoints, arch):
    path, hf = checkpoints[arch]
    llm = LLM(path, num_kv_blocks=64, block_size=4)
    prompts = [PROMPT, PROMPT[:4], PROMPT[3:12]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    hf.generation_config.eos_token_id = None  # both sides run through EOS (ignore_eos)
    for prompt, out in zip(prompts, outs):
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
        assert out.token_ids == ref
        assert out.finish_reason == "length"


def test_bf16_and_sharded_checkpoint(tmp_path, caplog):
    """A bf16 checkpoint split over several safetensors shards with an index loads and matches; on CPU the load
    says that fp32 is the fast choice there."""
    hf = make_checkpoint(tmp_path, "llama", seed=3, dtype=torch.bfloat16, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    with caplog.at_level("WARNING", logger="engine.runner.target"):
        engine = LLMEngine(EngineConfig(model=str(tmp_path), num_kv_blocks=32, block_size=4))
    assert engine.runner.dtype == torch.bfloat16
    assert "bf16 on CPU" in caplog.text and "float32" in caplog.text
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    got = engine_logits(engine, PROMPT, [9, 6])
    # bf16 through two layers: compare the distributions, and the argmax where it is clear-cut.
    torch.testing.assert_close(got.softmax(-1), ref.softmax(-1), atol=2e-2, rtol=0)
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.5
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])


def test_fp32_override_of_bf16_checkpoint(tmp_path):
    make_checkpoint(tmp_path, "qwen2", seed=4, dtype=torch.bfloat16)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=8))
    assert engine.runner.dtype == torch.float32 and engine.kv_cache.dtype == torch.float32
