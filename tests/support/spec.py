"""What the speculation tests share: varied prompts, a speculative config per method (the "self_draft"
method: the target as its own draft), greedy sampling parameters, and the padded graph layout run eagerly."""
from __future__ import annotations

import random

from engine import LLM, SamplingParams, SpecConfig


def random_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Varied lengths; some with repeats so that prompt lookup finds n-grams."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = [rng.randrange(3, 380) for _ in range(rng.randrange(3, 30))]
        if i % 2:
            p = p + p[: rng.randrange(2, 8)] + p
        out.append(p)
    return out


def spec_config(method: str, k: int, drafts: dict, llama_dir: str) -> SpecConfig:
    """`method` at `k` drafting with `drafts[method]` (the spec_drafts fixture's directories)."""
    if method == "self_draft":  # the target as its own draft model: every draft is accepted
        return SpecConfig(method="draft_model", k=k, draft=llama_dir)
    return SpecConfig(method=method, k=k, draft=drafts[method])


def greedy_params(max_tokens=20, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


def use_graphs(llm: LLM, capture: bool, max_batch: int = 8):
    """Switch the engine's runner to the graph layout (captured only with `capture`); returns its graphs,
    whose num_runs counts the steps that took it."""
    runner = llm.engine.runner
    runner.use_graphs(max_batch, capture=capture)
    return runner.graphs
