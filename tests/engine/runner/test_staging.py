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
    buf, (ta, tb) = to_device([a, b], torch.device("cpu"))
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
        sent.append(to_device(arrays, device)[1])
    torch.cuda.synchronize()
    for arrays, tensors in zip(want, sent):
        for a, t in zip(arrays, tensors):
            assert t.device.type == "cuda" and np.array_equal(t.cpu().numpy(), a)
