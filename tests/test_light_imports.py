"""The light side of the house imports without torch: the router (an HTTP front end), the prefill loop,
every module of structured/, and the engine's host bookkeeping (engine/core; engine/__init__.py hands its
names on lazily, PEP 562). Each check runs in a fresh interpreter, since this one has torch loaded already."""
import subprocess
import sys

import pytest

_ALL_OF_STRUCTURED = ("import importlib, pkgutil, structured\n"
                      "for m in pkgutil.walk_packages(structured.__path__, 'structured.'):\n"
                      "    importlib.import_module(m.name)")


@pytest.mark.parametrize("imports", [
    "import router, router.app",
    "import prefill_worker.loop",
    _ALL_OF_STRUCTURED,
    "from engine import SamplingParams, StructuredOutput, TandemError, InvalidRequestError",
    "import engine.core.scheduler, engine.core.block_manager, engine.core.request",
], ids=["router", "prefill_loop", "structured", "engine_names", "engine_core"])
def test_imports_without_torch(imports):
    code = f"{imports}\nimport sys\nheavy = sorted(m for m in ('torch', 'triton', 'xgrammar') if m in sys.modules)\nprint(heavy)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_engine_names_load_on_use():
    """Every public name resolves, and an unknown one is an AttributeError (so `from engine import
    submodule` still finds submodules)."""
    import engine

    for name in engine.__all__:
        assert getattr(engine, name) is not None
    with pytest.raises(AttributeError):
        engine.no_such_name  # noqa: B018
