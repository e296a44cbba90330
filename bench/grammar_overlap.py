"""How much of a grammar's compile the prompt's forward hides (issue 11, "compile overlapping the
prompt's forward"), in one engine process on the zoo target.

Per round, two fresh engines (so the compile child starts cold and the grammar cache is empty), the
same guided request (a JSONSchemaBench-like schema, a long prompt run in chunks):
  serial:  compile the grammar first (what add_request did before), then add the request;
  overlap: add the request at once (add_request starts the compile; the prompt's chunks run meanwhile).
Reported: time to the first token of each, the compile time alone, the prefill time alone (an
unguided twin), and the share of min(compile, prefill) the overlap hid. Best of --rounds, interleaved.

    nice -n 10 python -m bench.grammar_overlap [--prompt-tokens 768] [--rounds 3]
"""
from __future__ import annotations

import argparse
import time

from bench.common import write_results
from engine import EngineConfig, LLMEngine, SamplingParams, StructuredOutput

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[A-Za-z ]+$", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "format": "email"},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string",
                                                                                     "pattern": "^[0-9]{5}$"}},
                "required": ["street", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "address"], "additionalProperties": False}


def _engine(model: str, chunk: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, num_kv_blocks=512, block_size=16, max_num_batched_tokens=chunk))


def _first_token_s(engine: LLMEngine, prompt: list[int], params: SamplingParams, compile_first: bool) -> float:
    t0 = time.perf_counter()
    if compile_first:
        engine.guided.compiler().compile(params.structured_output)
    engine.add_request("r", prompt, params)
    while True:
        outs = engine.step()
        if any(o.token_ids or o.finished for o in outs):
            return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    import zoo

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=768)
    ap.add_argument("--chunk", type=int, default=128, help="max_num_batched_tokens (prefill chunk)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    model = str(zoo.layout(zoo.ensure_built()).target)
    prompt = [(i * 37) % 2000 + 10 for i in range(args.prompt_tokens)]
    guided = SamplingParams(max_tokens=1, temperature=0.0, structured_output=StructuredOutput(json_schema=SCHEMA))
    plain = SamplingParams(max_tokens=1, temperature=0.0)
    best = {"serial": 1e9, "overlap": 1e9, "prefill": 1e9, "compile": 1e9}
    for _ in range(args.rounds):
        best["prefill"] = min(best["prefill"], _first_token_s(_engine(model, args.chunk), prompt, plain, False))
        engine = _engine(model, args.chunk)
        t0 = time.perf_counter()
        engine.guided.compiler().compile(guided.structured_output)
        best["compile"] = min(best["compile"], time.perf_counter() - t0)
        best["serial"] = min(best["serial"], _first_token_s(_engine(model, args.chunk), prompt, guided, True))
        best["overlap"] = min(best["overlap"], _first_token_s(_engine(model, args.chunk), prompt, guided, False))
    hideable = min(best["compile"], best["prefill"])
    hidden = (best["serial"] - best["overlap"]) / hideable if hideable > 0 else None
    md = ("# Grammar compile overlapping the prompt (engine, CPU)\n\n"
          f"Zoo target, {args.prompt_tokens}-token prompt in chunks of {args.chunk}, first guided request of a fresh "
          f"engine (cold compile child). Best of {args.rounds} interleaved rounds.\n\n"
          "| | seconds |\n|---|---|\n"
          f"| compile alone (cold child) | {best['compile']:.3f} |\n| prefill alone (unguided) | {best['prefill']:.3f} |\n"
          f"| first token, compile then prompt (before) | {best['serial']:.3f} |\n"
          f"| first token, compile overlapping the prompt (now) | {best['overlap']:.3f} |\n\n"
          f"Serial / overlap: {best['serial'] / best['overlap']:.2f}x; the overlap hid "
          f"{'-' if hidden is None else f'{100 * hidden:.0f}%'} of min(compile, prefill).\n")
    print(md)
    print(write_results("grammar_overlap_cpu", {**best, "hidden_share": hidden, **vars(args)}, md))


if __name__ == "__main__":
    main()
