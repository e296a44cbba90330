"""The content-addressed zoo cache: ~/.cache/tandem/zoo/<recipe>-<key>/ (TANDEM_CACHE moves the root).

key = sha256 of (recipe incl. seed and thread count, the source of every zoo module that shapes
the weights, every input byte of the corpus, and the versions of python/torch/transformers/
tokenizers). A second build with the same key returns at once; builds of the same key in parallel
(two test sessions) wait on a file lock, and a finished zoo appears by an atomic rename, so a reader
never sees half a zoo.

Builds run in a child Python process with OMP_WAIT_POLICY=PASSIVE: on a CPU shared with other
jobs, spinning OpenMP threads made training several times slower.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from zoo.recipe import Recipe

ZOO_DIR = Path(__file__).parent
# Modules that do not change what a build writes (the CLI, eval, the test plugin, data curation, the
# cache and prebuilt lookup, the package's entry points).
NOT_BUILD_INPUTS = {"cli.py", "evaluate.py", "testing.py", "curate.py", "report.py", "cache.py", "prebuilt.py",
                    "__init__.py", "generation_eval.py", "models.py", "selfdistill.py", "selfdistill_train.py"}
MANIFEST = "zoo.json"


class BuildError(RuntimeError):
    """The zoo build failed; the message carries the child's exit status and its last output."""


def cache_root() -> Path:
    root = os.environ.get("TANDEM_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "tandem"


def code_version() -> str:
    digest = hashlib.sha256()
    for path in sorted(ZOO_DIR.rglob("*.py")):
        if path.name in NOT_BUILD_INPUTS:
            continue
        digest.update(str(path.relative_to(ZOO_DIR)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def software_versions() -> dict[str, str]:
    import tokenizers
    import torch
    import transformers

    return {
        "python": platform.python_version(), "torch": torch.__version__,
        "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
    }


def cache_key(recipe: Recipe) -> str:
    from zoo.corpus import corpus_fingerprint

    payload = {
        "recipe": recipe.to_dict(), "code": code_version(),
        "corpus": corpus_fingerprint(recipe.stdlib_modules), "versions": software_versions(),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def zoo_dir_for(recipe: Recipe) -> Path:
    return cache_root() / "zoo" / f"{recipe.name}-s{recipe.seed}-{cache_key(recipe)}"


def is_built(path: Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


@contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.setdefault("TOKENIZERS_PARALLELISM", "true")
    env["PYTHONPATH"] = os.pathsep.join([str(ZOO_DIR.parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def build_cached(recipe: Recipe, force: bool = False) -> Path:
    """The zoo directory for `recipe`, building it (in a child process) when it is not cached."""
    final = zoo_dir_for(recipe)
    if is_built(final) and not force:
        return final
    with _locked(final.with_name(final.name + ".lock")):
        if is_built(final) and not force:
            return final  # another process built it while we waited
        staging = final.with_name(f".{final.name}.tmp{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        command = [sys.executable, "-m", "zoo.builder", "--recipe", json.dumps(recipe.to_dict()), "--dest", str(staging)]
        result = subprocess.run(command, env=build_env(), stdout=subprocess.PIPE, text=True)
        if result.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            raise BuildError(f"zoo build exited with {result.returncode}: {result.stdout[-2000:]}")
        if final.exists():
            shutil.rmtree(final)
        os.rename(staging, final)
    return final


def copy_zoo(source: Path, dest: Path) -> Path:
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source, dest, dirs_exist_ok=True)
    return dest
