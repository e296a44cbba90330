"""The engine tests' fixtures: small random checkpoints saved inside the test session (deterministic), one per
architecture, with the tiny tokenizer, and draft checkpoints for the llama target (tests/support/checkpoints.py
and draft_heads.py build them)."""
from __future__ import annotations

import pytest
import torch

from tests.support.checkpoints import ARCHS, make_checkpoint
from tests.support.draft_heads import make_eagle3_head, make_mtp_head


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """arch -> (model dir, transformers model in fp32)."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for arch in ARCHS:
        path = root / arch
        out[arch] = (str(path), make_checkpoint(path, arch))
    return out


@pytest.fixture(scope="session")
def llama_dir(checkpoints):
    return checkpoints["llama"][0]


@pytest.fixture(scope="session")
def spec_drafts(tmp_path_factory, llama_dir):
    """method -> draft directory for the llama target (random heads in the published layouts, and a
    second random Llama as the separate draft model)."""
    root = tmp_path_factory.mktemp("spec")
    make_checkpoint(root / "draft_model", "llama", seed=7)
    return {
        "mtp": str(make_mtp_head(root / "mtp", llama_dir, seed=1)),
        "eagle3": str(make_eagle3_head(root / "eagle3", llama_dir, seed=2)),
        "draft_model": str(root / "draft_model"),
        "ngram": None,
    }


@pytest.fixture(scope="module")
def one_thread_module():
    """Tiny models: intra-op threads only add synchronization, and on a shared CPU they spin."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
