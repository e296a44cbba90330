"""engine/runner/staging.py: a step's host arrays packed into one buffer and read back as typed views."""
import numpy as np
import pytest
import torch

from engine.runner.staging import in_buffer, layout, pack, rebase, to_device, views


def _arrays(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(-5, 1 << 40, size=7, dtype=np.int64), rng.integers(0, 1000, size=(3, 5), dtype=np.int32),
            rng.random(3, dtype=np.float32), rng.random(9) > 0.5, np.zeros((4, 0), dtype=np.int64),
            rng.integers(0, 9, size=(2, 3), dtype=np.int64)]


def test_packed_views_equal_the_arrays_with_their_shapes_and_dtypes():
    arrays = _arrays(0)
    offsets, total = layout(arrays)
    assert all(off % 16 == 0 for off in offsets) and total >= sum(a.nbytes for a in arrays)
    buf = torch.zeros(total, dtype=torch.uint8)
    pack(arrays, offsets, buf.numpy())
    for a, t in zip(arrays, views(buf, arrays, offsets)):
        assert t.shape == a.shape and t.dtype == torch.from_numpy(a).dtype
        assert np.array_equal(t.numpy(), a)


def test_cpu_arrays_are_views_of_one_buffer_holding_a_copy():
    a, b = np.arange(5, dtype=np.int64), np.ones(3, dtype=np.bool_)
    buf, (ta, tb), _ = to_device([a, b], torch.device("cpu"))
    assert in_buffer(ta, buf) and in_buffer(tb, buf) and not in_buffer(torch.from_numpy(a), buf)
    ta.add_(1)
    assert a.tolist() == [0, 1, 2, 3, 4] and ta.tolist() == [1, 2, 3, 4, 5] and tb.tolist() == [True] * 3
    other = buf.clone()
    assert rebase(tb, other).tolist() == [True] * 3 and in_buffer(rebase(ta, other), other)
    assert rebase(ta, other).tolist() == [1, 2, 3, 4, 5]


@pytest.mark.gpu
def test_cuda_copies_stay_correct_while_the_host_runs_ahead():
    """More steps than pinned buffers are staged behind a long kernel: no buffer is overwritten before its copy."""
    device = torch.device("cuda")
    sent, want = [], []
    torch.cuda._sleep(200_000_000)  # the stream is busy while the host stages
    for step in range(12):
        arrays = _arrays(step)
        want.append(arrays)
        sent.append(to_device(arrays, device).tensors)
    torch.cuda.synchronize()
    for arrays, tensors in zip(want, sent):
        for a, t in zip(arrays, tensors):
            assert t.device.type == "cuda" and np.array_equal(t.cpu().numpy(), a)


@pytest.mark.parametrize("mixed", [False, True])
def test_padded_replays_load_the_packed_inputs_in_one_copy(llama_dir, spec_drafts, monkeypatch, mixed):
    """Greedy steps share the captured layout and load in one copy of the packed buffer; a step whose sampling
    columns lie elsewhere (seeded sampling adds one) loads field by field. Either way: the eager step's tokens."""
    from engine import LLM, SamplingParams
    from engine.runner import graphs as graphs_module
    from tests.support.spec import random_prompts, spec_config, use_graphs

    prompts = random_prompts(6, seed=3)
    params = [SamplingParams(max_tokens=5 + i, temperature=0.8 if mixed and i % 2 else 0.0, seed=7 + i,
                             ignore_eos=True) for i in range(6)]
    spec = spec_config("eagle3", 3, spec_drafts, llama_dir)
    eager = LLM(llama_dir, num_kv_blocks=128, block_size=4, speculative=spec).generate(prompts, params)
    llm = LLM(llama_dir, num_kv_blocks=128, block_size=4, speculative=spec)
    graphs = use_graphs(llm, capture=False)
    field_by_field = []
    copy_fields = graphs_module._copy_fields
    monkeypatch.setattr(graphs_module, "_copy_fields", lambda *a: field_by_field.append(1) or copy_fields(*a))
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in eager]
    assert graphs.num_runs > 2
    assert (len(field_by_field) > 0) == mixed, (len(field_by_field), graphs.num_runs)
