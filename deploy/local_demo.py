"""`tandem generate`: run the single-process engine on a prompt and print the generation.

Default: the zoo target (built once and cached) answering a JSON-Schema prompt with the zoo's template.
"""
from __future__ import annotations

import argparse
import json
import time


def _default_model() -> str:
    import zoo

    return str(zoo.build() / "target")


def _default_prompt() -> str:
    from zoo.prompts import json_schema_prompt

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "tags": {"type": "array", "items": {"type": "string"}}},
              "required": ["name", "age"]}
    return json_schema_prompt(schema)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem generate", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="HF model directory (default: the zoo target)")
    ap.add_argument("--prompt", help="prompt text (default: a JSON-Schema prompt)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)

    from engine import LLM, SamplingParams, TandemError

    model = args.model or _default_model()
    prompt = args.prompt if args.prompt is not None else _default_prompt()
    try:
        llm = LLM(model, device=args.device)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        start = time.perf_counter()
        out = llm.generate(prompt, params)[0]
    except TandemError as e:
        print(f"error: {e.message}")
        return 2
    elapsed = time.perf_counter() - start
    print(f"model:  {model}")
    print(f"prompt: {json.dumps(prompt)}")
    print(f"output: {out.text}")
    print(f"{len(out.token_ids)} tokens in {elapsed:.2f}s ({len(out.token_ids) / elapsed:.1f} tok/s), "
          f"finish_reason={out.finish_reason}")
    return 0
