"""EngineSettings: each engine setting defined once, and EngineConfig made from it without loss."""
from __future__ import annotations

import dataclasses

import pytest

from cluster.settings import EngineSettings
from engine import EngineConfig


@pytest.fixture()
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")  # settings check only that it is a model directory
    return str(tmp_path)


def test_defaults_are_the_engines(model_dir):
    """A setting the engine also has starts from the engine's default, so leaving it out changes nothing."""
    engine_defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    shared = set(EngineSettings.model_fields) & set(engine_defaults)
    assert {"device", "dtype", "block_size", "num_kv_blocks", "max_num_seqs", "seed"} <= shared
    settings = EngineSettings(model=model_dir)
    for name in shared - {"model"}:
        assert getattr(settings, name) == engine_defaults[name], name


def test_engine_config_takes_every_shared_field_and_the_speculation(model_dir):
    settings = EngineSettings(model=model_dir, block_size=8, num_kv_blocks=33, max_num_seqs=5, seed=7,
                              speculative_method="ngram", num_speculative_tokens=2)
    cfg = settings.engine_config(tp_size=2, tp_rank=1)
    assert (cfg.model, cfg.block_size, cfg.num_kv_blocks, cfg.max_num_seqs, cfg.seed, cfg.tp_size, cfg.tp_rank) == (
        model_dir, 8, 33, 5, 7, 2, 1)
    assert (cfg.speculative.method, cfg.speculative.k) == ("ngram", 2)
    assert EngineSettings(model=model_dir).engine_config().speculative is None
    # bf16 weights reach prefill and decode engines alike (their KV must come from the same rounded weights)
    assert EngineSettings(model=model_dir, weight_dtype="bfloat16").engine_config(cpu_compile="off").weight_dtype == \
        "bfloat16"
    assert EngineSettings(model=model_dir, speculative_method="ngram").speculative["k"] == 3


def test_bad_settings_are_refused_early(model_dir):
    with pytest.raises(ValueError, match="not a model directory"):
        EngineSettings(model=model_dir + "/nope")
    with pytest.raises(ValueError, match="weight_dtype"):
        EngineSettings(model=model_dir, weight_dtype="int4")
    with pytest.raises(ValueError, match="block_sise"):
        EngineSettings(model=model_dir, block_sise=8)  # a misspelt YAML key is an error, not ignored
    with pytest.raises(ValueError, match="draft"):
        EngineSettings(model=model_dir, speculative_method="eagle3")
    with pytest.raises(ValueError, match="choose a speculative_method"):
        EngineSettings(model=model_dir, speculative_token_map="map.json")
    with pytest.raises(ValueError, match="token map"):
        EngineSettings(model=model_dir, speculative_method="ngram", speculative_token_map="map.json")


def test_forced_drafts_and_the_grammar_method_reach_the_engines_spec_config(model_dir):
    spec = EngineSettings(model=model_dir, speculative_method="grammar").engine_config().speculative
    assert (spec.method, spec.k, spec.forced_drafts, spec.uses_model) == ("grammar", 3, True, False)
    off = EngineSettings(model=model_dir, speculative_method="ngram", forced_drafts=False)
    assert off.engine_config().speculative.forced_drafts is False


def test_a_token_map_reaches_the_engines_spec_config(model_dir):
    settings = EngineSettings(model=model_dir, speculative_method="mtp", speculative_token_map="/maps/hot.json")
    assert settings.engine_config().speculative.token_map == "/maps/hot.json"
    assert EngineSettings(model=model_dir, speculative_method="mtp").engine_config().speculative.token_map is None
