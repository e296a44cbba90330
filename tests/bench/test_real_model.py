"""bench/real_model.py's --heads: which head sets a speculation run compares."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.real_model import _head_sets, _token_map_path


def _heads(root: Path, kinds: tuple[str, ...], token_map: bool) -> Path:
    for kind in kinds:
        (root / kind).mkdir(parents=True)
        (root / kind / "config.json").write_text("{}")
        if token_map and kind == "mtp":
            (root / kind / "token_map.json").write_text("[0]")
    return root


def test_shipped_and_labelled_head_sets(tmp_path):
    shipped = SimpleNamespace(heads={"mtp": Path("/s/mtp")}, token_maps={"mtp": Path("/s/mtp/token_map.json")})
    new = _heads(tmp_path / "new", ("mtp", "eagle3"), token_map=True)
    sets = _head_sets(f"shipped, new={new}", shipped)
    assert [label for label, _, _ in sets] == ["shipped", "new"]
    assert sets[0][1] == {"mtp": Path("/s/mtp")}
    assert sets[1][1] == {"mtp": new / "mtp", "eagle3": new / "eagle3"}
    assert _token_map_path("shipped", sets[1][2], "mtp") == new / "mtp" / "token_map.json"
    with pytest.raises(SystemExit, match="eagle3 head ships no token map"):
        _token_map_path("shipped", sets[1][2], "eagle3")


def test_a_head_set_must_name_a_folder_with_heads(tmp_path):
    paths = SimpleNamespace(heads={}, token_maps={})
    with pytest.raises(SystemExit, match="LABEL=DIR"):
        _head_sets(str(tmp_path), paths)
    with pytest.raises(SystemExit, match="holds no mtp"):
        _head_sets(f"x={tmp_path}", paths)
