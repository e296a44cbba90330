"""`tandem zoo ...`: build, path, train-draft, eval.

    tandem zoo build [--recipe NAME] [--seed N] [--out DIR] [--from-scratch] [--force]
    tandem zoo path [--recipe NAME] [--seed N]
    tandem zoo publish --recipe NAME --command "..." [--zoo DIR]   # commit a build as zoo/prebuilt/NAME
    tandem zoo train-draft --target DIR --kind mtp|eagle3 --data FILE [--out DIR] [--steps N] ...
    tandem zoo eval [--size tiny] [--zoo DIR] [--results DIR]
    tandem zoo token-map --size N --out FILE [--recipe NAME]   # a hot draft vocabulary (SpecConfig.token_map)
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

# Before torch loads its OpenMP runtime: idle threads sleep instead of spinning, which matters a lot
# on a CPU that other jobs share (spinning made training several times slower there).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from zoo import DEFAULT_SIZE  # noqa: E402
from zoo.recipe import RECIPES  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem zoo", description="small real checkpoints, built locally")
    sub = parser.add_subparsers(dest="command", required=True)
    sizes = sorted(RECIPES)

    build = sub.add_parser("build", help="the zoo: its prebuilt copy when one matches, else build (cached)")
    build.add_argument("--recipe", "--size", dest="size", choices=sizes, default=DEFAULT_SIZE)
    build.add_argument("--seed", type=int, default=None)
    build.add_argument("--out", type=Path, default=None, help="also copy the built zoo here")
    build.add_argument("--from-scratch", action="store_true", help="train it here even when a prebuilt zoo matches")
    build.add_argument("--force", action="store_true", help="rebuild even when cached (implies --from-scratch)")

    path = sub.add_parser("path", help="print the directory of the built zoo")
    path.add_argument("--recipe", "--size", dest="size", choices=sizes, default=DEFAULT_SIZE)
    path.add_argument("--seed", type=int, default=None)

    publish = sub.add_parser("publish", help="copy a from-scratch build to zoo/prebuilt/<recipe>/ with a manifest")
    publish.add_argument("--recipe", "--size", dest="size", choices=sizes, required=True)
    publish.add_argument("--seed", type=int, default=None)
    publish.add_argument("--zoo", type=Path, default=None, help="the built zoo (default: the cached build)")
    publish.add_argument("--command", dest="built_by", required=True, help="the command line that built it (recorded)")

    train = sub.add_parser("train-draft", help="train an MTP or EAGLE-3 head for an HF Llama-family target")
    train.add_argument("--target", type=Path, required=True, help="HF model directory")
    train.add_argument("--kind", choices=["mtp", "eagle3"], required=True)
    train.add_argument("--data", type=Path, required=True, help=".jsonl (text | schema+instance | messages) or text")
    train.add_argument("--out", type=Path, default=None, help="default: <target>-<kind>")
    train.add_argument("--steps", type=int, default=200)
    train.add_argument("--batch-size", type=int, default=8)
    train.add_argument("--seq-len", type=int, default=512)
    train.add_argument("--lr", type=float, default=2e-3)
    train.add_argument("--depth", type=int, default=3, help="training-time-test depth")
    train.add_argument("--draft-vocab-size", type=int, default=None)
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--device", default=None, help="default: cuda when available, else cpu")

    ev = sub.add_parser("eval", help="evaluate a built zoo; writes bench/results/zoo_eval.{json,md}")
    ev.add_argument("--recipe", "--size", dest="size", choices=sizes, default=DEFAULT_SIZE)
    ev.add_argument("--seed", type=int, default=None)
    ev.add_argument("--zoo", type=Path, default=None, help="a zoo directory (default: the cached build)")
    ev.add_argument("--results", type=Path, default=None, help="output directory (default: bench/results)")
    ev.add_argument("--docs", type=int, default=120, help="held-out documents per domain")
    ev.add_argument("--prompts", type=int, default=64, help="held-out schema prompts to generate from")
    ev.add_argument("--max-new-tokens", type=int, default=256)
    ev.add_argument("--text-prompts", type=int, default=32,
                    help="held-out GSM8K questions whose greedy answers measure acceptance on natural text")
    ev.add_argument("--k", type=int, default=3, help="drafts per step for the acceptance comparison")
    ev.add_argument("--baseline", type=Path, default=None, help="an earlier zoo_eval.json to report beside")
    tm = sub.add_parser("token-map", help="write the N most frequent token ids of the zoo's training corpus: a hot "
                                          "vocabulary for its MTP head (--speculative-token-map)")
    tm.add_argument("--recipe", dest="recipe_name", choices=sizes, default=DEFAULT_SIZE)
    tm.add_argument("--selfdistill", type=Path, help="rank a real target's ids by its self-distilled responses "
                                                     "(python -m zoo.selfdistill) instead of the zoo's corpus")
    tm.add_argument("--target", help="with --selfdistill: the target's directory or .gguf (its vocabulary)")
    tm.add_argument("--size", type=int, required=True, help="token ids in the map")
    tm.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    return parser


def _build(args) -> int:
    import zoo
    from zoo.cache import BuildError
    from zoo.prebuilt import PrebuiltError

    try:
        root = zoo.build(args.size, seed=args.seed, out=args.out, force=args.force, from_scratch=args.from_scratch)
    except (BuildError, PrebuiltError) as err:
        print(f"tandem zoo build: {err}", file=sys.stderr)
        return 1
    manifest = json.loads(zoo.layout(root).manifest.read_text())
    print(f"{args.size} zoo (built in {manifest['build_seconds']} s, peak {manifest['peak_rss_mb']} MB): {root}",
          file=sys.stderr)
    print(root)
    return 0


def _path(args) -> int:
    import zoo

    from zoo.prebuilt import PrebuiltError

    try:
        root = zoo.built_path(args.size, seed=args.seed)
    except PrebuiltError as err:
        print(f"tandem zoo path: {err}", file=sys.stderr)
        return 1
    if root is None:
        print(f"tandem zoo path: the {args.size} zoo is not built; run `tandem zoo build --recipe {args.size}`",
              file=sys.stderr)
        return 1
    print(root)
    return 0


def _publish(args) -> int:
    import zoo
    from zoo.prebuilt import PrebuiltError, publish, verify

    root = args.zoo
    if root is None:
        from zoo.cache import is_built, zoo_dir_for

        root = zoo_dir_for(zoo.RECIPES[args.size] if args.seed is None else zoo.RECIPES[args.size].with_seed(args.seed))
        if not is_built(root):
            print(f"tandem zoo publish: no cached {args.size} build; run `tandem zoo build --recipe {args.size} "
                  "--from-scratch` first or pass --zoo DIR", file=sys.stderr)
            return 1
    manifest = json.loads(zoo.layout(root).manifest.read_text())
    try:
        dest = publish(Path(root), args.built_by, manifest["build_seconds"])
        verify(dest)
    except PrebuiltError as err:
        print(f"tandem zoo publish: {err}", file=sys.stderr)
        return 1
    print(dest)
    return 0


def _train_draft(args) -> int:
    from zoo.train_draft import DataError, train_draft_head

    out = args.out or args.target.with_name(f"{args.target.name}-{args.kind}")
    try:
        summary = train_draft_head(args.target, args.kind, args.data, out, steps=args.steps,
                                   batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, depth=args.depth,
                                   draft_vocab_size=args.draft_vocab_size, seed=args.seed, device=args.device)
    except (DataError, OSError, ValueError) as err:
        print(f"tandem zoo train-draft: {err}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2))
    return 0


def _eval(args) -> int:
    import zoo
    from zoo.evaluate import evaluate_zoo
    from zoo.prebuilt import PrebuiltError
    from zoo.report import RESULTS_DIR, write_results

    try:
        root = args.zoo or zoo.built_path(args.size, seed=args.seed)
    except PrebuiltError as err:
        print(f"tandem zoo eval: {err}", file=sys.stderr)
        return 1
    if root is None or not zoo.layout(root).manifest.is_file():
        print("tandem zoo eval: no built zoo; run `tandem zoo build` or pass --zoo DIR", file=sys.stderr)
        return 1
    if not zoo.layout(root).eagle3.is_dir():  # a MoE zoo (zoo/moe.py): target and its own MTP layer only
        print("tandem zoo eval: evaluates the Llama zoos' three drafters; a MoE zoo's MTP layer is measured by "
              "`python -m bench.moe_spec`", file=sys.stderr)
        return 2
    baseline = json.loads(args.baseline.read_text()) if args.baseline else None
    result = evaluate_zoo(Path(root), max_docs=args.docs, gen_prompts=args.prompts,
                          max_new_tokens=args.max_new_tokens, k=args.k, baseline=baseline,
                          text_prompts=args.text_prompts)
    result["command"] = "tandem zoo " + shlex.join(args.argv)
    json_path, md_path = write_results(result, args.results or RESULTS_DIR)
    print(md_path.read_text())
    print(f"wrote {json_path} and {md_path}", file=sys.stderr)
    return 0


def _token_map(args) -> int:
    import zoo
    from zoo.prompts import END
    from zoo.stages import corpus_token_counts
    from zoo.token_map import hot_token_ids, write_token_map
    from zoo.tokenizer import load_tokenizer

    if args.selfdistill is not None:
        return _token_map_selfdistill(args)
    paths = zoo.layout(zoo.build(args.recipe_name))
    tokenizer = load_tokenizer(paths.tokenizer)
    if not 0 < args.size <= tokenizer.get_vocab_size():
        print(f"tandem zoo token-map: --size must be in [1, {tokenizer.get_vocab_size()}] (the vocabulary), "
              f"got {args.size}", file=sys.stderr)
        return 2
    counts = corpus_token_counts(zoo.RECIPES[args.recipe_name], paths.tokenizer)
    ids = hot_token_ids(counts, args.size, always=(tokenizer.token_to_id(END),))
    doc = write_token_map(args.out, ids, counts)
    print(f"{args.out}: {args.size} of {doc['vocab_size']} ids, {doc['corpus_coverage']:.1%} of the corpus' tokens",
          file=sys.stderr)
    return 0


def _token_map_selfdistill(args) -> int:
    from transformers import AutoConfig, AutoTokenizer

    from zoo.token_map import hot_token_ids, selfdistill_counts, write_token_map

    if not args.target:
        print("tandem zoo token-map: --selfdistill needs --target (the target's directory or .gguf)", file=sys.stderr)
        return 2
    from engine.models.gguf import gguf_model_dir, is_gguf

    target = str(gguf_model_dir(args.target)) if is_gguf(args.target) else args.target
    vocab = AutoConfig.from_pretrained(target).vocab_size
    if not 0 < args.size <= vocab:
        print(f"tandem zoo token-map: --size must be in [1, {vocab}] (the vocabulary), got {args.size}", file=sys.stderr)
        return 2
    tok = AutoTokenizer.from_pretrained(target)
    always = tuple(sorted({t for t in (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) if t is not None}))
    responses, prompts = selfdistill_counts(args.selfdistill, vocab)
    doc = write_token_map(args.out, hot_token_ids(responses, args.size, always, tiebreak=prompts), responses)
    print(f"{args.out}: {args.size} of {vocab} ids, {doc['corpus_coverage']:.1%} of the responses' tokens",
          file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    args.argv = argv
    handlers = {"build": _build, "path": _path, "publish": _publish, "train-draft": _train_draft, "eval": _eval,
                "token-map": _token_map}
    return handlers[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
