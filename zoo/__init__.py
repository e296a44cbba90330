"""Tandem's model zoo: small real checkpoints built locally, deterministically, from a recipe and a seed.

    import zoo
    root = zoo.build()            # the default zoo: prebuilt (zoo/prebuilt/) or built and cached; -> its directory
    paths = zoo.layout(root)      # paths.target, paths.draft, paths.mtp, paths.eagle3, paths.tokenizer
    zoo.ensure_built()            # the same as zoo.build() for the default size

See zoo/README.md for the layout, the checkpoint formats and the prompt template (zoo.prompts).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from zoo.recipe import RECIPES, Recipe, get_recipe

# The recipe that build(), ensure_built() and the `zoo_dir` test fixture give by default. It lives here,
# not in recipe.py, because it does not shape any weights (recipe.py is part of the build cache key).
DEFAULT_SIZE = "writer"

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
          force: bool = False, from_scratch: bool = False) -> Path:
    """The zoo for `size`: its prebuilt directory (zoo/prebuilt/<recipe>/, verified against its
    manifest) when one matches the recipe and seed, else the cached build, building it first if needed.

    `from_scratch` skips the prebuilt zoo; `force` also rebuilds a cached build. With `out`, the zoo is
    also copied there and `out` is returned. A prebuilt file that does not match the manifest raises
    zoo.prebuilt.PrebuiltError.
    """
    from zoo.cache import build_cached, copy_zoo
    from zoo.prebuilt import find

    recipe = _recipe(size, seed)
    root = None if (force or from_scratch) else find(recipe)
    if root is None:
        root = build_cached(recipe, force=force)
    return copy_zoo(root, Path(out)) if out is not None else root


def ensure_built(size: str | Recipe = DEFAULT_SIZE, *, seed: int | None = None) -> Path:
    """The directory of the zoo for `size`: the prebuilt one if it matches, else built (and cached)."""
    return build(size, seed=seed)


def built_path(size: str | Recipe = DEFAULT_SIZE, *, seed: int | None = None) -> Path | None:
    """The prebuilt or cached zoo directory for `size` if there is one, else None (never builds)."""
    from zoo.cache import is_built, zoo_dir_for
    from zoo.prebuilt import find

    recipe = _recipe(size, seed)
    prebuilt = find(recipe)
    if prebuilt is not None:
        return prebuilt
    root = zoo_dir_for(recipe)
    return root if is_built(root) else None
