"""Tandem's model zoo: small real checkpoints built locally, deterministically, from a recipe and a seed.

    import zoo
    root = zoo.build()            # build or reuse (cache) the default "tiny" zoo; -> its directory
    paths = zoo.layout(root)      # paths.target, paths.draft, paths.mtp, paths.eagle3, paths.tokenizer
    zoo.ensure_built()            # the same as zoo.build() for the default size

See zoo/README.md for the layout, the checkpoint formats and the prompt template (zoo.prompts).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from zoo.recipe import DEFAULT_SIZE, RECIPES, Recipe, get_recipe

__all__ = ["DEFAULT_SIZE", "RECIPES", "Recipe", "ZooLayout", "build", "built_path", "ensure_built", "layout"]


@dataclass(frozen=True, slots=True)
class ZooLayout:
    root: Path
    tokenizer: Path
    target: Path
    draft: Path
    mtp: Path
    eagle3: Path
    manifest: Path


def layout(root: Path | str) -> ZooLayout:
    root = Path(root)
    return ZooLayout(root, root / "tokenizer", root / "target", root / "draft", root / "mtp",
                     root / "eagle3", root / "zoo.json")


def _recipe(size: str | Recipe, seed: int | None) -> Recipe:
    recipe = size if isinstance(size, Recipe) else get_recipe(size)
    return recipe if seed is None else recipe.with_seed(seed)


def build(size: str | Recipe = DEFAULT_SIZE, *, seed: int | None = None, out: Path | str | None = None,
          force: bool = False) -> Path:
    """Build the zoo for `size` (or reuse the cached build) and return its directory.

    With `out`, the built zoo is also copied there and `out` is returned.
    """
    from zoo.cache import build_cached, copy_zoo

    root = build_cached(_recipe(size, seed), force=force)
    return copy_zoo(root, Path(out)) if out is not None else root


def ensure_built(size: str | Recipe = DEFAULT_SIZE, *, seed: int | None = None) -> Path:
    """The directory of the built zoo for `size`, building it first if the cache lacks it."""
    return build(size, seed=seed)


def built_path(size: str | Recipe = DEFAULT_SIZE, *, seed: int | None = None) -> Path | None:
    """The cached zoo directory for `size` if it is built, else None (never builds)."""
    from zoo.cache import is_built, zoo_dir_for

    root = zoo_dir_for(_recipe(size, seed))
    return root if is_built(root) else None
