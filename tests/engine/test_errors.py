"""Bad input gets a typed error that names the problem, and the engine keeps serving the others."""
import json

import pytest
from safetensors.torch import load_file, save_file

from engine import (EngineConfig, InvalidRequestError, LLMEngine, ModelLoadError, SamplingParams,
                    UnsupportedModelError)
from tests.support.checkpoints import make_checkpoint


@pytest.mark.parametrize("kwargs,param", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"temperature": -1.0}, "temperature"),
    ({"top_k": -2}, "top_k"), ({"min_p": 2.0}, "min_p"), ({"logprobs": 50}, "logprobs"),
    ({"stop": [""]}, "stop"), ({"seed": -1}, "seed"),
])
def test_invalid_sampling_params(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and param in e.value.message


def test_bad_prompts_do_not_disturb_running_requests(llama_dir):
    engine = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=64, block_size=4, max_model_len=64))
    engine.add_request("good", [5, 6, 7], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    engine.step()
    with pytest.raises(InvalidRequestError, match="prompt has 64 tokens"):
        engine.add_request("long", [5] * 64, SamplingParams())
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        engine.add_request("oov", [5, 100000], SamplingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("empty", [], SamplingParams())
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("good", [5], SamplingParams())
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished]
    assert [(o.request_id, len(o.token_ids)) for o in done] == [("good", 12)]
    assert engine.stats()["kv_blocks_used"] == 0


def test_generation_stops_at_max_model_len(llama_dir):
    engine = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=64, block_size=4, max_model_len=20))
    engine.add_request("r", [5] * 15, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    out = []
    while engine.has_unfinished():
        out += engine.step()
    assert out[-1].finish_reason == "length" and len(out[-1].token_ids) == 5


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"}))
    with pytest.raises(UnsupportedModelError, match="GPTNeoXForCausalLM"):
        LLMEngine(EngineConfig(model=str(tmp_path)))


def test_not_a_model_directory(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json is missing"):
        LLMEngine(EngineConfig(model=str(tmp_path)))


def _mutate(path, fn):
    f = path / "model.safetensors"
    tensors = load_file(str(f))
    fn(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def test_missing_weight_is_named(tmp_path):
    make_checkpoint(tmp_path, "llama", seed=1)
    _mutate(tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        LLMEngine(EngineConfig(model=str(tmp_path), num_kv_blocks=8))


def test_misshapen_weight_is_named(tmp_path):
    make_checkpoint(tmp_path, "qwen2", seed=1)

    def shrink(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:-1].clone()

    _mutate(tmp_path, shrink)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*shape"):
        LLMEngine(EngineConfig(model=str(tmp_path), num_kv_blocks=8))


def test_no_weights_at_all(tmp_path):
    make_checkpoint(tmp_path, "llama", seed=1)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        LLMEngine(EngineConfig(model=str(tmp_path), num_kv_blocks=8))
