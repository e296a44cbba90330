"""pytest plugin: the session-scoped `zoo_dir` fixture (register with `pytest_plugins = ["zoo.testing"]`).

`zoo_dir` is the directory of the default zoo: the prebuilt one committed under zoo/prebuilt/ (checked
against its manifest once per session, no training), or for a recipe without one, a build made once per
machine through the build cache. Set TANDEM_ZOO_DIR to use a zoo built elsewhere, or TANDEM_ZOO_SIZE
to pick another recipe.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def zoo_dir() -> Path:
    import zoo

    given = os.environ.get("TANDEM_ZOO_DIR")
    if given:
        root = Path(given)
        if not zoo.layout(root).manifest.is_file():
            pytest.fail(f"TANDEM_ZOO_DIR={given} is not a built zoo (no zoo.json)")
        return root
    return zoo.ensure_built(os.environ.get("TANDEM_ZOO_SIZE", zoo.DEFAULT_SIZE))
