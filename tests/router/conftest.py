"""`served`: the server the client-library suite runs against (issue 32): the session's tiny model
(`tandem_server`), and, marked slow, the real default model as `tandem serve` runs it with no flags
(SmolLM2-135M-Instruct, tests/support/served.py), so that the same cases judge the protocol on a model
that writes real text. Module-scoped and parametrized: in each module pytest runs every tiny case, then
starts the SmolLM2 server for its cases and stops it at the module's end. Not session-scoped: the server's
processes run below pytest's, where tests/router/test_faults.py looks for the session's router replicas
(a live SmolLM2 server there is a second router)."""
from __future__ import annotations

import pytest

from tests.support.served import DEFAULT_MODEL, default_model_server


@pytest.fixture(scope="module", params=["tiny", pytest.param(DEFAULT_MODEL, marks=pytest.mark.slow)])
def served(request):
    """A deploy.testing.TandemServer-shaped handle (base_url, model, model_dir, openai())."""
    if request.param == "tiny":
        yield request.getfixturevalue("tandem_server")
        return
    from deploy.testing import TandemServer

    model_dir = request.getfixturevalue("smollm2_dir")
    with default_model_server() as base_url:
        yield TandemServer(base_url, model_dir, DEFAULT_MODEL, config=None)
