"""The built default zoo (session fixture `zoo_dir`): formats, loading, and how well the heads agree.

The default zoo is the prebuilt one committed under zoo/prebuilt/ (no training in a test session).
"""
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import zoo
from zoo.corpus import build_corpus, heldout_cases
from zoo.evaluate import agreement, load_models
from zoo.heads.eagle3 import EAGLE3_WEIGHT_NAMES, default_aux_layer_ids
from zoo.heads.mtp import MTP_MODULE_NAMES
from zoo.prompts import json_schema_prompt
from zoo.tokenizer import TOKENIZER_FILES, load_tokenizer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def paths(zoo_dir):
    return zoo.layout(zoo_dir)


@pytest.fixture(scope="module")
def target(paths):
    return AutoModelForCausalLM.from_pretrained(paths.target).eval()


def test_target_is_a_self_contained_hf_llama(paths, target):
    config = json.loads((paths.target / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert (paths.target / "model.safetensors").is_file()
    for name in TOKENIZER_FILES:
        assert (paths.target / name).read_bytes() == (paths.tokenizer / name).read_bytes()
    tok = AutoTokenizer.from_pretrained(paths.target)
    assert tok.eos_token == "<|end|>" and tok.chat_template
    assert sum(p.numel() for p in target.parameters()) > 1_000_000


def test_target_logits_survive_save_and_reload(target, tmp_path):
    ids = torch.randint(6, target.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = target(input_ids=ids).logits
    target.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, before)


def test_mtp_checkpoint(paths, target):
    n = target.config.num_hidden_layers
    state = load_file(str(paths.mtp / "model.safetensors"))
    assert set(state) == {f"model.layers.{n}.{name}" for name in MTP_MODULE_NAMES}
    h, v = target.config.hidden_size, target.config.vocab_size
    assert state[f"model.layers.{n}.eh_proj.weight"].shape == (h, 2 * h)
    assert torch.equal(state[f"model.layers.{n}.shared_head.head.weight"], target.lm_head.weight)
    assert torch.equal(state[f"model.layers.{n}.embed_tokens.weight"], target.model.embed_tokens.weight)
    assert state[f"model.layers.{n}.shared_head.head.weight"].shape == (v, h)
    config = json.loads((paths.mtp / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == n


def test_eagle3_checkpoint(paths, target):
    state = load_file(str(paths.eagle3 / "model.safetensors"))
    assert set(state) == set(EAGLE3_WEIGHT_NAMES)
    config = json.loads((paths.eagle3 / "config.json").read_text())
    h, v, n = target.config.hidden_size, target.config.vocab_size, target.config.num_hidden_layers
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["vocab_size"] == v and config["target_hidden_size"] == h
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == default_aux_layer_ids(n)
    draft_v = config["draft_vocab_size"]
    assert state["fc.weight"].shape == (h, 3 * h)
    assert state["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * h
    assert state["lm_head.weight"].shape == (draft_v, h)
    assert state["t2d"].shape == (v,) and int(state["t2d"].sum()) == draft_v
    assert state["t2d"][torch.arange(draft_v) + state["d2t"]].all()
    assert state["t2d"][target.config.eos_token_id]


def test_draft_model_shares_the_tokenizer_and_assists_generation(paths, target):
    draft = AutoModelForCausalLM.from_pretrained(paths.draft).eval()
    assert draft.config.num_hidden_layers <= 2 and draft.config.vocab_size == target.config.vocab_size
    tok = load_tokenizer(paths.tokenizer)
    prompt = torch.tensor([tok.encode(json_schema_prompt(heldout_cases()[0]["schema"])).ids])
    kwargs = dict(max_new_tokens=24, do_sample=False, eos_token_id=2, pad_token_id=2)
    plain = target.generate(prompt, **kwargs)
    assisted = target.generate(prompt, assistant_model=draft, **kwargs)
    assert torch.equal(plain, assisted)  # assisted decoding is lossless for greedy


def test_heads_agree_with_the_target_on_heldout_json(zoo_dir, record_property):
    """Depth-1 agreement on JSON instances of schemas no model trained on (reported, with a floor)."""
    manifest = json.loads(zoo.layout(zoo_dir).manifest.read_text())
    target, draft, mtp, eagle3 = load_models(zoo_dir)
    tokenizer = load_tokenizer(zoo.layout(zoo_dir).tokenizer)
    docs = [d for d in build_corpus(manifest["recipe"]["stdlib_modules"]).heldout if d.domain == "json"][:24]
    result = agreement(target, draft, {"mtp": mtp, "eagle3": eagle3}, tokenizer, docs, depth=3)
    for key in ("mtp/instance", "eagle3/instance", "draft/instance"):
        record_property(key, result[key])
    print({k: v for k, v in result.items() if k != "positions"})
    # Floors under what the default `writer` zoo reaches on these 24 documents (MTP 0.58/0.56/0.55,
    # EAGLE-3 0.41/0.41/0.40 at depths 1-3; the looping `tiny` target was easier to agree with): a head
    # that stopped learning (random: about 0.0), or a chain that drifts on its own hidden states
    # (depths 2, 3 falling away from depth 1), fails.
    assert result["mtp/instance"][0] > 0.45 and result["eagle3/instance"][0] > 0.3
    for key in ("mtp/instance", "eagle3/instance"):
        assert min(result[key]) > result[key][0] - 0.08, key
    # By the target's confidence: the bands split exactly the scored positions, and every model agrees far more
    # where the target is sure (writer: MTP 0.87 at >= 0.9 against 0.22 below 0.5) than where it hesitates.
    bands = result["by_confidence"]
    assert sum(bands["positions"]) == result["positions"]["draft/instance"][0]
    for model in ("mtp", "eagle3", "draft"):
        assert bands[model][-1] > bands[model][0] + 0.3, (model, bands[model])
