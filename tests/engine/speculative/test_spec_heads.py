"""Draft heads (engine/models/mtp.py, eagle3.py) against the plain-torch reference of
tests/support/draft_heads.py, and the errors a bad draft checkpoint gets."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import EngineConfig, LLMEngine, ModelLoadError, SamplingParams, SpecConfig
from tests.support.draft_heads import make_mtp_head, reference_drafts


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread_module):
    """Tiny models: one intra-op thread (tests/engine/conftest.py)."""


PROMPT = [5, 9, 22, 41, 8, 120, 7, 33, 8, 120]


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_head_drafts_match_the_reference(checkpoints, llama_dir, spec_drafts, kind):
    """The head's drafts after the prefill and after decoding steps equal a from-scratch recomputation:
    the draft KV over the prompt, its rewind and the chain positions are right."""
    _, hf = checkpoints["llama"]
    k = 4
    engine = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=64, block_size=4,
                                    speculative=SpecConfig(method=kind, k=k, draft=spec_drafts[kind])))
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    req = engine.requests["r"]
    for _ in range(4):
        engine.step()
        assert req.spec_token_ids == reference_drafts(hf, spec_drafts[kind], kind, req.token_ids, k)


def test_draft_model_drafts_are_its_greedy_continuation(checkpoints, llama_dir, spec_drafts):
    from transformers import AutoModelForCausalLM

    draft = AutoModelForCausalLM.from_pretrained(spec_drafts["draft_model"]).eval()
    draft.generation_config.eos_token_id = None
    engine = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=64, block_size=4,
                                    speculative=SpecConfig(method="draft_model", k=3, draft=spec_drafts["draft_model"])))
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    req = engine.requests["r"]
    for _ in range(4):
        engine.step()
        ids = torch.tensor([req.token_ids])
        ref = draft.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False)[0, ids.shape[1]:]
        assert req.spec_token_ids == ref.tolist()


def test_heads_share_the_targets_embedding_and_lm_head_when_omitted(checkpoints, llama_dir, tmp_path, spec_drafts):
    """An MTP checkpoint without embed_tokens/shared_head, and an EAGLE-3 one without lm_head (its
    vocabulary is then the target's rows d2t selects), load and draft like the complete ones."""
    _, hf = checkpoints["llama"]
    lean = make_mtp_head(tmp_path / "mtp", llama_dir, seed=1, shared=False)
    e3 = Path(spec_drafts["eagle3"])
    (tmp_path / "e3").mkdir()
    tensors = load_file(str(e3 / "model.safetensors"))
    ids = torch.arange(tensors["d2t"].numel()) + tensors["d2t"]
    del tensors["lm_head.weight"]
    save_file(tensors, str(tmp_path / "e3" / "model.safetensors"))
    (tmp_path / "e3" / "config.json").write_text((e3 / "config.json").read_text())
    full_e3 = {**tensors, "lm_head.weight": hf.get_output_embeddings().weight[ids].detach().clone()}
    (tmp_path / "e3ref").mkdir()
    save_file(full_e3, str(tmp_path / "e3ref" / "model.safetensors"))
    (tmp_path / "e3ref" / "config.json").write_text((e3 / "config.json").read_text())
    for kind, d, ref_dir in [("mtp", lean, spec_drafts["mtp"]), ("eagle3", tmp_path / "e3", tmp_path / "e3ref")]:
        engine = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=64, block_size=4,
                                        speculative=SpecConfig(method=kind, k=3, draft=str(d))))
        engine.add_request("r", PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        engine.step()
        req = engine.requests["r"]
        assert req.spec_token_ids == reference_drafts(hf, ref_dir, kind, req.token_ids, 3)


def _edit(src, dst, drop=(), replace=None, config=None) -> str:
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(Path(src) / "model.safetensors"))
    for name in drop:
        del tensors[name]
    tensors.update(replace or {})
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((Path(src) / "config.json").read_text())
    cfg.update(config or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.mark.parametrize("case", ["mtp-missing", "mtp-shape", "mtp-no-layer", "eagle3-missing", "eagle3-shape",
                                  "eagle3-d2t", "eagle3-aux", "draft-missing", "no-dir"])
def test_bad_draft_checkpoints_name_the_problem(llama_dir, spec_drafts, tmp_path, case):
    mtp, e3 = spec_drafts["mtp"], spec_drafts["eagle3"]
    p = "model.layers.2."
    cases = {  # case -> (method, make the checkpoint, what the error must name)
        "mtp-missing": ("mtp", lambda: _edit(mtp, tmp_path, drop=[p + "eh_proj.weight"]), p + "eh_proj.weight"),
        "mtp-shape": ("mtp", lambda: _edit(mtp, tmp_path, replace={p + "hnorm.weight": torch.ones(3)}),
                      p + "hnorm.weight"),
        "mtp-no-layer": ("mtp", lambda: _edit(mtp, tmp_path, config={"num_nextn_predict_layers": 0}),
                         "num_nextn_predict_layers"),
        "eagle3-missing": ("eagle3", lambda: _edit(e3, tmp_path, drop=["midlayer.self_attn.o_proj.weight"]),
                           "midlayer.self_attn.o_proj.weight"),
        "eagle3-shape": ("eagle3", lambda: _edit(e3, tmp_path, replace={"fc.weight": torch.zeros(64, 128)}), "fc.weight"),
        "eagle3-d2t": ("eagle3", lambda: _edit(e3, tmp_path, replace={"d2t": torch.full((200,), 10_000)}), "d2t"),
        "eagle3-aux": ("eagle3", lambda: _edit(e3, tmp_path, config={"eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [1, 2, 9]}}), "aux hidden-state layer ids"),
        "draft-missing": ("draft_model", lambda: _edit(spec_drafts["draft_model"], tmp_path, drop=["model.norm.weight"]),
                          "model.norm.weight"),
        "no-dir": ("eagle3", lambda: str(tmp_path / "nowhere"), "config.json is missing"),
    }
    method, make, match = cases[case]
    draft = make()
    with pytest.raises(ModelLoadError, match=match.replace(".", r"\.").replace("[", r"\[")):
        LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=16, block_size=4,
                               speculative=SpecConfig(method=method, k=2, draft=draft)))


def test_spec_config_rejects_bad_values():
    with pytest.raises(ValueError, match="unknown speculative method"):
        SpecConfig(method="medusa")
    for k in (0, 9):
        with pytest.raises(ValueError, match=r"k must be an integer in \[1, 8\]"):
            SpecConfig(method="ngram", k=k)
    with pytest.raises(ValueError, match="needs `draft`"):
        SpecConfig(method="eagle3")
