"""zoo/moe.py and zoo/heads/deepseek_mtp.py: the DeepSeek-V3-shaped zoo.

On `micro-moe` (built here, seconds): same recipe and seed give the same bytes; the target loads in transformers
with a trained (non-zero) routing bias; the MTP layer saved beside it is what the engine's DeepSeek MTP head
computes; the parallel training-time unroll equals a plain causal run of the block. On the prebuilt `tiny-moe`
(no training): the engine equals transformers greedily and its own MTP layer drafts losslessly, and accepts."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from zoo.builder import build_zoo
from zoo.prebuilt import file_hashes
from zoo.recipe import RECIPES

PROMPT = [1, 4, 30, 31, 32, 33, 40, 41, 5]


@pytest.fixture(scope="module")
def micro_moe(tmp_path_factory):
    base = tmp_path_factory.mktemp("micro-moe")
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        build_zoo(RECIPES["micro-moe"].with_seed(seed), base / name)
    return base


def test_same_recipe_and_seed_give_identical_files(micro_moe):
    a, b, c = (file_hashes(micro_moe / name) for name in "abc")
    assert {"target/model.safetensors", "target/mtp.safetensors", "tokenizer/tokenizer.json"} <= a.keys()
    assert {k: v for k, v in a.items() if k != "zoo.json"} == {k: v for k, v in b.items() if k != "zoo.json"}
    for name in ("target/model.safetensors", "target/mtp.safetensors"):
        assert a[name] != c[name], name


def test_target_loads_in_transformers_with_a_trained_routing_bias(micro_moe):
    from transformers import DeepseekV3ForCausalLM

    target = micro_moe / "a" / "target"
    assert json.loads((target / "config.json").read_text())["num_nextn_predict_layers"] == 1
    hf = DeepseekV3ForCausalLM.from_pretrained(target, dtype=torch.float32)
    moe = RECIPES["micro-moe"].moe
    assert type(hf.model.layers[0].mlp).__name__ == "DeepseekV3MLP"  # first_k_dense_replace
    bias = hf.model.layers[moe.first_k_dense_replace].mlp.gate.e_score_correction_bias
    assert bias.abs().max() > 0 and len(set(bias.tolist())) > 1
    manifest = json.loads((micro_moe / "a" / "zoo.json").read_text())
    assert manifest["routing_imbalance"]["target"] and manifest["losses"]["mtp_last"] > 0


@pytest.fixture(scope="module")
def random_layer(micro_moe, tmp_path_factory):
    """(dir, transformers target, a random DeepseekMTPLayer saved beside it): every weight exercised."""
    from transformers import DeepseekV3ForCausalLM

    from zoo.heads.deepseek_mtp import DeepseekMTPLayer

    path = tmp_path_factory.mktemp("layer") / "target"
    shutil.copytree(micro_moe / "a" / "target", path)
    hf = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    layer = DeepseekMTPLayer.from_target(hf, torch.Generator().manual_seed(3)).eval()
    with torch.no_grad():
        for name, buf in layer.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.rand(buf.shape, generator=torch.Generator().manual_seed(4)) * 0.1)
        for name, p in layer.named_parameters():
            if p.requires_grad and "norm" not in name:
                p.mul_(8.0)  # well-separated logits
    layer.save_beside(path)
    return path, hf, layer


def test_the_engine_reads_the_saved_layer_as_trained(random_layer):
    """The engine's draft logits over a prompt (the first chain step) equal the zoo module's step 0."""
    from engine import EngineConfig, LLMEngine, SpecConfig
    from tests.support.deepseek import mtp_logits_over_prompt

    path, hf, layer = random_layer
    engine = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=32, block_size=4,
                                    speculative=SpecConfig("mtp", k=1)))
    got, n = mtp_logits_over_prompt(engine, PROMPT), len(PROMPT)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        final = hf.model(ids).last_hidden_state[:, :-1]
        _, want = layer.step(final, ids[:, 1:], torch.arange(n - 1)[None], [])
    torch.testing.assert_close(got, want[0], atol=2e-4, rtol=1e-4)


def test_the_parallel_unroll_equals_a_causal_chain(random_layer):
    """Regression guard for the training-time-test mask: step 1 at index i equals the block run causally over
    step 0's inputs at indices <= i followed by step 1's input at i (what a two-token draft chain sees)."""
    _, hf, layer = random_layer
    ids = torch.tensor([PROMPT])
    t = ids.shape[1]
    positions = torch.arange(t)[None]
    with torch.no_grad():
        final = hf.model(ids).last_hidden_state
        cache = []
        out0 = layer.step_hidden(final, ids.roll(-1, 1), positions, cache)
        out1 = layer.step_hidden(out0, ids.roll(-2, 1), positions + 1, cache)
        x0, x1 = cache[0][0], cache[1][0]
        for i in (0, 3, t - 1):
            xs = torch.cat([x0[:, : i + 1], x1[:, i: i + 1]], dim=1)
            pos = torch.cat([positions[:, : i + 1], positions[:, i: i + 1] + 1], dim=1)
            m = xs.shape[1]
            mask = torch.full((m, m), float("-inf")).triu(1)[None, None]
            y = layer.block(xs, attention_mask=mask, position_ids=pos, position_embeddings=layer.rotary(xs, pos))
            torch.testing.assert_close(out1[:, i], layer.shared_head.norm(y[:, -1]), atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def tiny_moe():
    from zoo.models import resolve

    return resolve("tandem-tiny-moe")


def test_prebuilt_tiny_moe_equals_transformers_and_its_mtp_layer_accepts(tiny_moe):
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM

    from engine import LLM, SamplingParams, SpecConfig
    from zoo.prompts import json_schema_prompt

    assert tiny_moe.heads["mtp"] == tiny_moe.target
    tok = AutoTokenizer.from_pretrained(tiny_moe.target)
    prompt = tok(json_schema_prompt({"type": "object", "properties": {"id": {"type": "integer"}}}),
                 add_special_tokens=False)["input_ids"]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = LLM(str(tiny_moe.target), num_kv_blocks=64).generate([prompt], greedy)[0].token_ids
    hf = DeepseekV3ForCausalLM.from_pretrained(tiny_moe.target, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    want = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                       max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    assert plain == want
    spec = LLM(str(tiny_moe.target), num_kv_blocks=64, speculative=SpecConfig(method="mtp", k=2))
    assert spec.generate([prompt], greedy)[0].token_ids == plain
    hist = spec.engine.spec_stats.accepted_length_hist
    assert sum(hist[2:]) > 0, f"the trained MTP layer never had a draft accepted: {hist}"


def test_named_model_and_cli_point_at_the_moe_zoo(tiny_moe, capsys):
    """`tandem models path tandem-tiny-moe --head mtp` is the target directory (the layer lives in its checkpoint);
    `tandem zoo eval`, written for the Llama zoos' three drafters, refuses a MoE zoo saying what measures it."""
    from pathlib import Path

    from zoo.cli import main as zoo_main
    from zoo.models import main as models_main

    assert models_main(["path", "tandem-tiny-moe", "--head", "mtp"]) == 0
    head = Path(capsys.readouterr().out.strip())
    assert head == tiny_moe.target and (head / "mtp.safetensors").is_file()
    assert zoo_main(["eval", "--recipe", "tiny-moe"]) == 2
    assert "bench.moe_spec" in capsys.readouterr().err
