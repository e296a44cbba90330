"""`tandem generate`: run the single-process engine on a prompt and print the generation.

Default: SmolLM2-135M-Instruct (the default named model) answering a chat question through its chat template;
`--model tandem-tiny` answers a JSON-Schema prompt in the zoo's template. `--model` also takes a model directory
or a .gguf file.
"""
from __future__ import annotations

import argparse
import json
import time


CHAT_QUESTION = "Describe a cat as a JSON object with a name, an age and a list of tags."


def _model_dir(model: str | None) -> str:
    from zoo.models import DEFAULT_MODEL, is_name, resolve

    model = model or DEFAULT_MODEL
    return str(resolve(model).target) if is_name(model) else model


def _zoo_prompt() -> str:
    from zoo.prompts import json_schema_prompt

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "tags": {"type": "array", "items": {"type": "string"}}},
              "required": ["name", "age"]}
    return json_schema_prompt(schema)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem generate", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a named model (tandem models list), an HF model directory or a .gguf file "
                                    "(default: smollm2-135m-instruct)")
    ap.add_argument("--prompt", help="raw prompt text (default: a chat question in the model's chat template)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)

    from engine import LLM, SamplingParams, TandemError

    from zoo.models import UnknownModelError

    try:
        model = _model_dir(args.model)
    except UnknownModelError as e:
        print(f"error: {e}")
        return 2
    try:
        llm = LLM(model, device=args.device)
        if args.prompt is not None:
            prompt = args.prompt
        elif args.model == "tandem-tiny":
            prompt = _zoo_prompt()
        else:
            prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": CHAT_QUESTION}], tokenize=False,
                                                       add_generation_prompt=True)
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
