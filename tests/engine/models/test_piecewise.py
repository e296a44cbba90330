"""engine/models/piecewise.py: the CPU forward compiled piecewise between its attentions."""
import pytest
import torch

from engine import LLM, SamplingParams
from kernels import cpu_ext


def _run(path: str, prompts: list[list[int]], **kwargs):
    llm = LLM(path, max_num_seqs=4, num_kv_blocks=64, block_size=16, **kwargs)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params)
    return llm, [o.token_ids for o in outs], [[lp.logprob for lp in o.logprobs] for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("arch,mode", [("llama3", "layers"), ("qwen2", "layers"), ("qwen3", "layers"),
                                       ("llama3", "full"), ("qwen2", "full"), ("qwen3", "full")])  # rope scaling; qkv bias; q/k norms
def test_layers_match_the_eager_forward(checkpoints, arch, mode, one_thread_module):
    """Three requests decode together (3 rows, padded to the 4-row pieces), one alone at the end (1 row);
    a 20-token prompt runs its prefill eagerly (past the largest bucket), a 3-token one through pieces.
    Tokens equal the eager engine's, log-probabilities within float tolerance. "full": each bucket one graph,
    the C++ attention inside, reading the step's block tables and padding rows as the pieces' eager one does."""
    path = checkpoints[arch][0]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in (20, 3, 7)]
    _, want, want_lp = _run(path, prompts)
    llm, got, got_lp = _run(path, prompts, cpu_compile=mode)
    assert got == want
    for g, w in zip(got_lp, want_lp):
        torch.testing.assert_close(torch.tensor(g), torch.tensor(w), rtol=1e-4, atol=1e-4)
    pieces = llm.engine.runner.model.piecewise
    assert pieces.runs >= 8  # the decode steps (one batch of ten tokens) and the short prompts
    assert {1, 4} <= set(pieces.buckets) and all(pieces.buckets.values())
    # 16 rows at most, and under "full" a 32-row bucket that only the C++ stack op serves (streamed_gemm.py)
    assert max(pieces.buckets) <= (32 if mode == "full" and cpu_ext.available() else 16)
    assert pieces.whole == (set(pieces.buckets) if mode == "full" and cpu_ext.available() else set())
    # "full": the target's forward one C++ call (engine/models/native_stack.py), where it agreed on every probe
    assert pieces.native_buckets == pieces.whole
