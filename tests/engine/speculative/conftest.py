"""The speculation tests' own fixtures: the zoo's writer and its heads, prompts from its held-out schemas, and a draft
model near the target (for the sampling distribution tests)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def near_draft(llama_dir, tmp_path_factory):
    """The target with noise on its weights: a draft model whose distribution is close to the target's
    but not equal, so that verification accepts some drafts and rejects others."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("near_draft")
    shutil.copytree(llama_dir, path, dirs_exist_ok=True)
    g = torch.Generator().manual_seed(0)
    tensors = {name: t if "norm" in name else t + 0.3 * t.std() * torch.randn(t.shape, generator=g)
               for name, t in load_file(str(path / "model.safetensors")).items()}
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)


@pytest.fixture(scope="module")
def zoo(zoo_dir) -> Path:
    """The zoo's writer target with its trained heads (target/, mtp/, eagle3/, draft/)."""
    return Path(zoo_dir)


@pytest.fixture(scope="module")
def json_prompts() -> list[str]:
    """Prompts asking for JSON under five of the zoo's held-out schemas."""
    from zoo.corpus import heldout_cases
    from zoo.prompts import json_schema_prompt

    return [json_schema_prompt(row["schema"]) for row in heldout_cases()[:5]]
