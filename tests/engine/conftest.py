"""The engine tests' fixtures: small random checkpoints saved inside the test session (deterministic), one per
architecture, with the tiny tokenizer (tests/support/checkpoints.py builds them)."""
from __future__ import annotations

import pytest
import torch

from tests.support.checkpoints import ARCHS, make_checkpoint


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


@pytest.fixture(scope="module")
def one_thread_module():
    """Tiny models: intra-op threads only add synchronization, and on a shared CPU they spin."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
