"""SamplingParams.prompt_logprobs (engine/prompt_logprobs.py): each prompt token's logprob given the tokens
before it, and the top n, equal to transformers' own forward over the prompt; the first token has none; a
prompt run in chunks, and scored in chunks, gives the same; the pass writes no KV, so the output is the
output without it; a prefill-only request carries them in its output; bad values are refused."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError

PROMPT = "The quick brown fox jumps over the lazy dog. def add(a, b):"


def _reference(hf_model, ids: list[int]) -> torch.Tensor:
    """[n - 1, V] transformers' logprobs of the next token at each prompt position."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(-1)[:-1]


@pytest.mark.parametrize("chunk", [None, 7], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_transformers_and_leave_the_output_alone(checkpoints, chunk):
    model_dir, hf_model = checkpoints["llama"]
    kw = {"max_num_batched_tokens": chunk, "enable_chunked_prefill": True} if chunk else {}
    llm = LLM(model_dir, num_kv_blocks=64, block_size=4, **kw)
    ids = llm.tokenizer.encode(PROMPT)
    assert len(ids) > 2 * (chunk or 1)
    plain, scored = llm.generate([ids, ids], [SamplingParams(max_tokens=6, temperature=0),
                                              SamplingParams(max_tokens=6, temperature=0, prompt_logprobs=3)])
    assert plain.prompt_logprobs is None
    assert scored.token_ids == plain.token_ids  # the scoring pass wrote no KV
    ref = _reference(hf_model, ids)
    entries = scored.prompt_logprobs
    assert len(entries) == len(ids) and entries[0] is None
    for i, entry in enumerate(entries[1:]):
        assert entry.token_id == ids[i + 1]
        assert entry.logprob == pytest.approx(ref[i, ids[i + 1]].item(), abs=1e-4)
        top = ref[i].topk(3)
        assert list(entry.top) == top.indices.tolist()
        assert list(entry.top.values()) == pytest.approx(top.values.tolist(), abs=1e-4)


def test_a_prefill_only_request_reports_them_with_its_first_token(checkpoints):
    model_dir, hf_model = checkpoints["qwen2"]
    llm = LLM(model_dir, num_kv_blocks=64)
    ids = llm.tokenizer.encode(PROMPT)[:9]
    llm.engine.add_request("r", ids, SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0),
                           prefill_only=True)
    (out,) = llm.engine.step()
    assert len(out.token_ids) == 1 and not out.finished  # parked for its hand-over
    ref = _reference(hf_model, ids)
    assert [e.top for e in out.prompt_logprobs[1:]] == [None] * (len(ids) - 1)
    assert [e.logprob for e in out.prompt_logprobs[1:]] == pytest.approx(
        [ref[i, t].item() for i, t in enumerate(ids[1:])], abs=1e-4)
    llm.engine.release("r")


def test_a_one_token_prompt_has_only_the_first_entry(checkpoints):
    llm = LLM(checkpoints["llama"][0], num_kv_blocks=16)
    (out,) = llm.generate([[5]], SamplingParams(max_tokens=2, prompt_logprobs=1))
    assert out.prompt_logprobs == [None]


@pytest.mark.parametrize("value", [-1, 21, 1.5])
def test_bad_values_are_refused(value):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(prompt_logprobs=value)
    assert e.value.param == "prompt_logprobs"
