"""pytest plugin: the session-scoped `zoo_dir` and `smollm2_dir` fixtures (register with `pytest_plugins = ["zoo.testing"]`).

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


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The converted directory of the real default model, SmolLM2-135M-Instruct (zoo/models.py); `make test`
    installs its package. Without it the test is skipped, saying so (never passed silently)."""
    from zoo.models import UnknownModelError, resolve

    try:
        return str(resolve("smollm2-135m-instruct").target)
    except UnknownModelError as e:
        pytest.skip(str(e))
