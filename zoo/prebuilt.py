"""Prebuilt zoos: a built zoo committed under zoo/prebuilt/<recipe>/, used as is when its recipe matches.

Training the default zoo takes about an hour on two CPU cores, so it is trained once, with this
project's own builder, and committed. `prebuilt.json` beside the parts records the recipe, the command
that built it, how long it took, and the sha256 and size of every file; `zoo.build()` and friends
return the prebuilt directory when its recipe equals the one asked for, after checking every file
against that manifest (a corrupted or edited file is a `PrebuiltError` naming it, never a silent
rebuild). Anything else, and `tandem zoo build --from-scratch`, goes through the build cache.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from zoo.recipe import Recipe

PREBUILT_ROOT = Path(__file__).parent / "prebuilt"
MANIFEST = "prebuilt.json"
MAX_TOTAL_BYTES = 25 * 1024 * 1024  # what the repository carries for one prebuilt zoo
_verified: dict[Path, dict] = {}  # root -> the manifest it verified against (once per process)


class PrebuiltError(RuntimeError):
    """A prebuilt zoo does not match its manifest (a missing, extra or changed file)."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_hashes(root: Path) -> dict[str, dict]:
    """{relative path: {"sha256", "bytes"}} of every file under `root` except the prebuilt manifest."""
    root = Path(root)
    return {
        path.relative_to(root).as_posix(): {"sha256": sha256_file(path), "bytes": path.stat().st_size}
        for path in sorted(root.rglob("*")) if path.is_file() and path.name != MANIFEST
    }


def prebuilt_dir(name: str, prebuilt_root: Path | None = None) -> Path:
    return Path(prebuilt_root or PREBUILT_ROOT) / name


def read_manifest(root: Path) -> dict | None:
    path = Path(root) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def verify(root: Path) -> dict:
    """Check every file of the prebuilt zoo at `root` against its manifest; -> the manifest."""
    root = Path(root)
    manifest = read_manifest(root)
    if manifest is None:
        raise PrebuiltError(f"{root} has no {MANIFEST}: not a prebuilt zoo")
    listed = manifest["files"]
    found = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != MANIFEST}
    fix = (f"restore it from git (`git checkout -- {root}`) or rebuild it with "
           f"`tandem zoo build --recipe {manifest['recipe']['name']} --from-scratch`")
    missing = sorted(set(listed) - found)
    if missing:
        raise PrebuiltError(f"prebuilt zoo {root} lacks {', '.join(missing)}; {fix}")
    extra = sorted(found - set(listed))
    if extra:
        raise PrebuiltError(f"prebuilt zoo {root} has files its manifest does not list: {', '.join(extra)}; {fix}")
    for name, want in listed.items():
        got = sha256_file(root / name)
        if got != want["sha256"]:
            raise PrebuiltError(f"prebuilt zoo file {root / name} is corrupted: sha256 {got[:16]}..., "
                                f"the manifest says {want['sha256'][:16]}...; {fix}")
    return manifest


def find(recipe: Recipe, prebuilt_root: Path | None = None) -> Path | None:
    """The verified prebuilt directory for exactly `recipe` (seed included), or None if there is none.

    Raises PrebuiltError if one exists for this recipe but its files do not match the manifest.
    """
    root = prebuilt_dir(recipe.name, prebuilt_root)
    manifest = read_manifest(root)
    if manifest is None or not _same_recipe(manifest["recipe"], recipe):
        return None
    key = root.resolve()
    if _verified.get(key) != manifest:
        _verified[key] = verify(root)
    return root


def _same_recipe(fields: dict, recipe: Recipe) -> bool:
    try:
        return Recipe.from_dict(fields) == recipe
    except (TypeError, KeyError):  # a manifest written by another version of the recipe fields
        return False


def publish(built: Path, command: str, seconds: float, prebuilt_root: Path | None = None) -> Path:
    """Copy the built zoo at `built` to zoo/prebuilt/<recipe>/ and write its manifest; -> that directory.

    `command` is the command line that built it and `seconds` the wall time it took.
    """
    zoo_manifest = json.loads((Path(built) / "zoo.json").read_text())
    recipe = zoo_manifest["recipe"]
    dest = prebuilt_dir(recipe["name"], prebuilt_root)
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(built, dest, ignore=shutil.ignore_patterns(MANIFEST, "*.lock"))
    files = file_hashes(dest)
    total = sum(f["bytes"] for f in files.values())
    if total > MAX_TOTAL_BYTES:
        shutil.rmtree(dest)
        raise PrebuiltError(f"the {recipe['name']} zoo is {total / 2**20:.1f} MiB, over the "
                            f"{MAX_TOTAL_BYTES / 2**20:.0f} MiB a prebuilt zoo may take")
    manifest = {
        "recipe": recipe,
        "command": command,
        "build_seconds": round(seconds, 1),
        "builder_manifest": "zoo.json",
        "code_version": zoo_manifest.get("code_version"),
        "versions": zoo_manifest.get("versions"),
        "total_bytes": total,
        "files": files,
    }
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return dest
