"""`served`: the server the client-library suite runs against (issue 32): the session's tiny model
(`tandem_server`), and, marked slow, the real default model as `tandem serve` runs it with no flags
(SmolLM2-135M-Instruct, tests/support/served.py), so that the same cases judge the protocol on a model
that writes real text.

The SmolLM2 server is started once for every module's cases (starting it is most of their cost): the
collection moves the default-model cases together, after the rest of tests/router, and the server stops after
the last of them. Not for the whole session: its processes run below pytest's, where
tests/router/test_faults.py looks for the session's router replicas (a live SmolLM2 server there is a second
router)."""
from __future__ import annotations

import contextlib

import pytest

from tests.support.served import DEFAULT_MODEL, default_model_server


class _DefaultModelServer:
    """The one SmolLM2 server: started by the first case that asks, closed after the last (see the hooks)."""

    def __init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None
        self.base_url: str | None = None

    def get(self) -> str:
        if self._stack is None:
            stack = contextlib.ExitStack()
            self.base_url = stack.enter_context(default_model_server())
            self._stack = stack
        return self.base_url

    def close(self) -> None:
        stack, self._stack, self.base_url = self._stack, None, None
        if stack is not None:
            stack.close()


_DEFAULT = _DefaultModelServer()


def _on_default_model(item) -> bool:
    callspec = getattr(item, "callspec", None)
    return callspec is not None and callspec.params.get("served") == DEFAULT_MODEL


@pytest.hookimpl(trylast=True)  # after pytest's own grouping by parametrized fixtures, within each module
def pytest_collection_modifyitems(items):
    moved = [item for item in items if _on_default_model(item)]
    if not moved:
        return
    rest = [item for item in items if not _on_default_model(item)]
    router = [n for n, item in enumerate(rest) if item.nodeid.startswith("tests/router/")]
    at = router[-1] + 1 if router else len(rest)
    items[:] = rest[:at] + moved + rest[at:]


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    if _on_default_model(item) and (nextitem is None or not _on_default_model(nextitem)):
        _DEFAULT.close()


def pytest_sessionfinish(session):
    _DEFAULT.close()  # an interrupted run


@pytest.fixture(scope="module", params=["tiny", pytest.param(DEFAULT_MODEL, marks=pytest.mark.slow)])
def served(request):
    """A deploy.testing.TandemServer-shaped handle (base_url, model, model_dir, openai())."""
    if request.param == "tiny":
        yield request.getfixturevalue("tandem_server")
        return
    from deploy.testing import TandemServer

    model_dir = request.getfixturevalue("smollm2_dir")
    yield TandemServer(_DEFAULT.get(), model_dir, DEFAULT_MODEL, config=None)
