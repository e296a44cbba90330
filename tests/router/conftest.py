"""`served`: the server the client-library suite runs against (issue 32): the session's tiny model
(`tandem_server`), and, marked slow, the real default model as `tandem serve` runs it with no flags
(SmolLM2-135M-Instruct: the session's one such server, tests/support/served.py's DEFAULT_SERVER, shared with
tests/deploy/test_default_model.py; tests/conftest.py runs its cases together and stops it after them), so
that the same cases judge the protocol on a model that writes real text."""
from __future__ import annotations

import pytest

from tests.support.served import DEFAULT_MODEL, DEFAULT_SERVER

ON_DEFAULT_MODEL = [pytest.mark.slow, pytest.mark.default_model_server]


@pytest.fixture(scope="module", params=["tiny", pytest.param(DEFAULT_MODEL, marks=ON_DEFAULT_MODEL)])
def served(request):
    """A deploy.testing.TandemServer-shaped handle (base_url, model, model_dir, openai())."""
    if request.param == "tiny":
        yield request.getfixturevalue("tandem_server")
        return
    from deploy.testing import TandemServer

    model_dir = request.getfixturevalue("smollm2_dir")
    yield TandemServer(DEFAULT_SERVER.get(), model_dir, DEFAULT_MODEL, config=None)
