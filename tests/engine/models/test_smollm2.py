"""The real default model, SmolLM2-135M-Instruct (from its GGUF), in the engine against transformers on the
same converted directory: logits, greedy generation through the chat template, every speculative method
lossless against the engine without speculation, and a guided answer valid against its schema."""
from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams, SpecConfig, StructuredOutput

pytestmark = pytest.mark.slow

CHATS = [
    "Write a JSON object describing a cat.",
    "What is 17 times 23? Think step by step.",
    "Write a Python function that reverses a string.",
]


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def prompts(hf):
    _, tok = hf
    out = []
    for text in CHATS:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


@pytest.fixture(scope="module")
def plain(smollm2_dir):
    return LLM(smollm2_dir, num_kv_blocks=256)


def test_greedy_generation_equals_transformers(hf, prompts, plain):
    model, _ = hf
    outs = plain.generate(prompts, SamplingParams(max_tokens=24, temperature=0))
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
        got = list(out.token_ids)
        assert got == ref[: len(got)] and (len(got) == len(ref) or got[-1] == model.config.eos_token_id)


def test_prompt_logits_equal_transformers(hf, prompts, plain):
    model, _ = hf
    out = plain.generate([prompts[0]], SamplingParams(max_tokens=1, temperature=0, logprobs=5))[0]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompts[0]])).logits[0, -1].float(), -1)
    top = out.logprobs[0].top
    ref_top = torch.topk(ref, 5)
    assert list(top) == ref_top.indices.tolist()
    for token, value in zip(ref_top.indices.tolist(), ref_top.values.tolist()):
        assert abs(top[token] - value) < 1e-3
    assert out.token_ids[0] == int(ref.argmax())


def _heads():
    from zoo.models import resolve

    return resolve("smollm2-135m-instruct").heads


LOSSLESS = SamplingParams(max_tokens=48, temperature=0)


@pytest.fixture(scope="module")
def plain_tokens(prompts, plain):
    """The engine's greedy tokens without speculation, once for every method's case."""
    return [list(o.token_ids) for o in plain.generate(prompts, LOSSLESS)]


@pytest.mark.parametrize("method", ["ngram", "mtp", "mtp+token_map", "eagle3"])
def test_speculation_is_lossless_on_the_real_model(smollm2_dir, prompts, plain_tokens, method):
    from zoo.models import resolve

    method, _, with_map = method.partition("+")
    heads, maps = _heads(), resolve("smollm2-135m-instruct").token_maps
    if method != "ngram" and method not in heads:
        pytest.skip(f"no prebuilt {method} head for smollm2-135m-instruct in zoo/prebuilt/")
    if with_map and method not in maps:
        pytest.skip(f"no token map ships with the {method} head")
    spec = SpecConfig(method=method, k=3, draft=str(heads[method]) if method in heads else None,
                      token_map=str(maps[method]) if with_map else None)
    llm = LLM(smollm2_dir, num_kv_blocks=256, speculative=spec)
    assert [list(o.token_ids) for o in llm.generate(prompts, LOSSLESS)] == plain_tokens


def test_a_guided_answer_is_valid_against_its_schema(plain, hf):
    import jsonschema

    _, tok = hf
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "color": {"enum": ["black", "white", "orange"]}},
              "required": ["name", "age", "color"]}
    ids = tok.apply_chat_template([{"role": "user", "content": "Describe a cat as JSON with name, age, color."}],
                                  add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    out = plain.generate([ids], SamplingParams(max_tokens=64, temperature=0,
                                               structured_output=StructuredOutput(json_schema=schema)))[0]
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), schema)
