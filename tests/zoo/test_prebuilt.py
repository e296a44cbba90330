"""zoo.prebuilt: the committed default zoo verifies against its manifest and is what zoo.build() gives;
a corrupted file is a clear error, never a silent rebuild; publish -> find round-trips."""
import json
import shutil

import pytest

import zoo
from zoo.builder import build_zoo
from zoo.prebuilt import MANIFEST, MAX_TOTAL_BYTES, PrebuiltError, file_hashes, find, prebuilt_dir, publish, verify
from zoo.recipe import RECIPES, Recipe


@pytest.fixture(scope="module")
def default_prebuilt():
    root = prebuilt_dir(zoo.DEFAULT_SIZE)
    if not (root / MANIFEST).is_file():
        pytest.fail(f"the default recipe {zoo.DEFAULT_SIZE!r} has no prebuilt zoo under {root}")
    return root


def test_default_prebuilt_verifies_and_records_how_it_was_made(default_prebuilt):
    manifest = verify(default_prebuilt)
    assert Recipe.from_dict(manifest["recipe"]) == RECIPES[zoo.DEFAULT_SIZE]
    assert manifest["command"] and manifest["build_seconds"] > 0
    assert manifest["total_bytes"] == sum(f["bytes"] for f in manifest["files"].values()) <= MAX_TOTAL_BYTES
    for part in ("tokenizer/tokenizer.json", "target/model.safetensors", "draft/model.safetensors",
                 "mtp/model.safetensors", "eagle3/model.safetensors", "zoo.json"):
        assert part in manifest["files"], part
    assert json.loads((default_prebuilt / "zoo.json").read_text())["recipe"] == manifest["recipe"]


def test_build_and_ensure_built_return_the_prebuilt_without_building(default_prebuilt, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    assert zoo.build() == zoo.ensure_built() == zoo.built_path() == default_prebuilt
    assert not (tmp_path / "cache").exists()  # nothing was built or even locked


def _copy(root, dest):
    shutil.copytree(root, dest)
    return dest


def test_a_corrupted_prebuilt_file_is_an_error_naming_it(default_prebuilt, tmp_path):
    root = _copy(default_prebuilt, tmp_path / zoo.DEFAULT_SIZE)
    weights = root / "mtp" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(PrebuiltError, match="mtp/model.safetensors is corrupted"):
        find(RECIPES[zoo.DEFAULT_SIZE], prebuilt_root=tmp_path)


def test_missing_and_unlisted_files_are_errors(default_prebuilt, tmp_path):
    root = _copy(default_prebuilt, tmp_path / "a")
    (root / "draft" / "config.json").unlink()
    with pytest.raises(PrebuiltError, match="lacks draft/config.json"):
        verify(root)
    root = _copy(default_prebuilt, tmp_path / "b")
    (root / "target" / "stray.bin").write_bytes(b"x")
    with pytest.raises(PrebuiltError, match="target/stray.bin"):
        verify(root)


def test_publish_then_find_round_trips_and_other_recipes_or_seeds_miss(tmp_path):
    recipe = RECIPES["micro"]
    build_zoo(recipe, tmp_path / "built")
    published = publish(tmp_path / "built", "build_zoo(micro)", 1.5, prebuilt_root=tmp_path / "prebuilt")
    assert published == tmp_path / "prebuilt" / "micro"
    assert find(recipe, prebuilt_root=tmp_path / "prebuilt") == published
    assert find(recipe.with_seed(1), prebuilt_root=tmp_path / "prebuilt") is None
    assert find(RECIPES["tiny"], prebuilt_root=tmp_path / "prebuilt") is None
    assert file_hashes(published) == file_hashes(tmp_path / "built")


def test_cli_reports_a_corrupted_prebuilt_instead_of_a_traceback(default_prebuilt, tmp_path, monkeypatch, capsys):
    from zoo import prebuilt
    from zoo.cli import main

    root = _copy(default_prebuilt, tmp_path / zoo.DEFAULT_SIZE)
    (root / "target" / "config.json").write_text("{}")
    monkeypatch.setattr(prebuilt, "PREBUILT_ROOT", tmp_path)
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    assert main(["build"]) == 1 and main(["path"]) == 1
    assert "target/config.json is corrupted" in capsys.readouterr().err
    assert not (tmp_path / "cache").exists()  # no silent rebuild
