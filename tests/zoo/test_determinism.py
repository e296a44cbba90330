"""Same recipe + seed + thread count -> the same bytes; the cache returns a build without rebuilding.

The `micro` rebuild runs the same code path (corpus, tokenizer, target, heads, save) that made the
prebuilt default zoo, so that code stays exercised and deterministic in CI."""
import hashlib
import json
import subprocess
import sys

import pytest

import zoo
from zoo.builder import build_zoo
from zoo.cache import cache_key
from zoo.prebuilt import file_hashes
from zoo.recipe import RECIPES

WEIGHT_FILES = ("tokenizer/tokenizer.json", "target/model.safetensors", "draft/model.safetensors",
                "mtp/model.safetensors", "eagle3/model.safetensors")


def _hashes(root):
    return {name: hashlib.sha256((root / name).read_bytes()).hexdigest() for name in WEIGHT_FILES}


@pytest.fixture(scope="module")
def micro_builds(tmp_path_factory):
    base = tmp_path_factory.mktemp("micro")
    recipe = RECIPES["micro"]
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        build_zoo(recipe.with_seed(seed), base / name)
    return base


def test_same_recipe_and_seed_give_identical_files(micro_builds):
    """Every file, configs and the tokenizer included; zoo.json differs only in time and memory."""
    a, b = file_hashes(micro_builds / "a"), file_hashes(micro_builds / "b")
    assert a.keys() == b.keys() and len(a) > 15
    assert {k: v for k, v in a.items() if k != "zoo.json"} == {k: v for k, v in b.items() if k != "zoo.json"}
    manifests = [json.loads((micro_builds / name / "zoo.json").read_text()) for name in "ab"]
    for manifest in manifests:
        del manifest["build_seconds"], manifest["peak_rss_mb"]
    assert manifests[0] == manifests[1]


def test_another_seed_gives_other_weights(micro_builds):
    a, c = _hashes(micro_builds / "a"), _hashes(micro_builds / "c")
    for name in WEIGHT_FILES[1:]:
        assert a[name] != c[name], name


def test_cache_key_covers_recipe_and_seed():
    tiny, micro = RECIPES["tiny"], RECIPES["micro"]
    assert cache_key(tiny) == cache_key(tiny)
    assert len({cache_key(tiny), cache_key(tiny.with_seed(1)), cache_key(micro)}) == 3


@pytest.mark.slow
def test_second_build_is_served_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    assert zoo.built_path("micro") is None
    first = zoo.build("micro")
    assert zoo.layout(first).manifest.is_file() and str(first).startswith(str(tmp_path / "cache"))
    # Served from the cache means no build process runs (an event, not a wall-clock bound).
    with monkeypatch.context() as m:
        m.setattr("zoo.cache.subprocess.run", lambda *a, **k: pytest.fail(f"a cached zoo was built again: {a}"))
        assert zoo.build("micro") == first
    assert zoo.built_path("micro") == first
    printed = subprocess.run([sys.executable, "-m", "zoo.cli", "path", "--size", "micro"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert printed == str(first)
    copied = zoo.build("micro", out=tmp_path / "copy")
    assert _hashes(copied) == _hashes(first)
