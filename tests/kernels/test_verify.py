"""kernels/verify.py: greedy and rejection verification, reference vs Triton vs a per-row oracle,
plus the statistical check that rejection sampling reproduces the target distribution."""
import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from scipy.stats import chisquare

from kernels import rng
from kernels._rng_triton import hash_key, stream_salt, uniform
from kernels.verify import (
    target_probs,
    verify_greedy,
    verify_greedy_ref,
    verify_greedy_triton,
    verify_rejection,
    verify_rejection_ref,
    verify_rejection_triton,
)


@triton.jit
def _uniform_kernel(seed_ptr, pos_ptr, out_ptr, N: tl.constexpr, SALT: tl.constexpr):
    r = tl.program_id(0)
    key = hash_key(tl.load(seed_ptr + r), tl.load(pos_ptr + r), SALT)
    idx = tl.arange(0, N)
    tl.store(out_ptr + r * N + idx, uniform(key, idx))


@pytest.mark.parametrize("stream", [rng.STREAM_SAMPLE, rng.STREAM_ACCEPT, rng.STREAM_RESIDUAL, rng.STREAM_DRAFT])
def test_triton_rng_is_bit_identical(stream):
    gen = torch.Generator().manual_seed(stream)
    seeds = torch.cat([torch.randint(-(2**63), 2**63 - 1, (6,), generator=gen), torch.tensor([0, -1, 2**32, 2**63 - 1])])
    pos = torch.cat([torch.randint(0, 2**40, (8,), generator=gen), torch.tensor([0, 2**32 - 1])])
    out = torch.empty(10, 64)
    _uniform_kernel[(10,)](seeds, pos, out, N=64, SALT=stream_salt(stream))
    assert torch.equal(out, rng.uniform(seeds, pos, 64, stream))


# ------------------------------------------------------------------------------------------- greedy


def greedy_oracle(logits, drafts):
    B, k1, _ = logits.shape
    out = torch.full((B, k1), -1, dtype=torch.int64)
    acc = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        for j in range(k1):
            t = int(np.argmax(logits[b, j].float().numpy()))  # first maximum, like torch
            out[b, j] = t
            if j == k1 - 1 or t != int(drafts[b, j]):
                break
            acc[b] += 1
    return out, acc


def greedy_case(B, k, V, seed, dtype=torch.float32, match=0.7):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, k + 1, V, generator=gen).to(dtype)
    drafts = torch.randint(0, V, (B, k), generator=gen)
    hit = torch.rand(B, k, generator=gen) < match
    drafts = torch.where(hit, logits[:, :k].argmax(-1), drafts)
    return logits, drafts


@pytest.mark.parametrize("fn", [verify_greedy_ref, verify_greedy_triton, verify_greedy])
@pytest.mark.parametrize("k", [0, 1, 2, 3, 5, 8])
@pytest.mark.parametrize("B,V", [(1, 7), (5, 33), (3, 1000)])
def test_greedy(fn, k, B, V):
    logits, drafts = greedy_case(B, k, V, seed=k * 100 + V)
    out, acc = fn(logits, drafts)
    want_out, want_acc = greedy_oracle(logits, drafts)
    assert out.dtype == torch.int64 and acc.dtype == torch.int32
    assert torch.equal(out, want_out) and torch.equal(acc, want_acc)


@pytest.mark.parametrize("chunk,dtype", [(32, torch.float32), (64, torch.bfloat16), (64, torch.float16)])
def test_greedy_triton_chunks_ties_dtypes(chunk, dtype):
    """Several vocab chunks, bf16 ties, rows fully at -inf (all tokens masked): first index wins."""
    logits, drafts = greedy_case(4, 3, 200, seed=1, dtype=dtype)
    logits[0, 0, [17, 90, 150]] = 50.0  # tie across chunks
    logits[1, 1] = float("-inf")
    logits[2].clamp_(max=0.5)  # many ties inside a chunk
    drafts[0, 0] = 17
    out, acc = verify_greedy_triton(logits, drafts, chunk=chunk)
    want_out, want_acc = greedy_oracle(logits, drafts)
    assert torch.equal(out, want_out) and torch.equal(acc, want_acc)


# ------------------------------------------------------------------------------- target processing


def test_target_probs_filters():
    logits = torch.log(torch.tensor([[[0.4, 0.3, 0.2, 0.1]]])).repeat(5, 1, 1)
    temperature = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0])
    top_k = torch.tensor([2, 0, 0, 0, 3], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.65, 0.75, 1.0, 0.8])
    p = target_probs(logits, temperature, top_k, top_p)[:, 0]
    torch.testing.assert_close(p[0], torch.tensor([4 / 7, 3 / 7, 0, 0]))
    torch.testing.assert_close(p[1], torch.tensor([4 / 7, 3 / 7, 0, 0]))  # 0.4 < 0.65 -> keep 2nd
    torch.testing.assert_close(p[2], torch.tensor([4 / 9, 3 / 9, 2 / 9, 0]))  # 0.7 < 0.75 -> keep 3rd
    assert torch.equal(p[3], torch.tensor([1.0, 0, 0, 0]))  # greedy
    # top-p on the top-k-renormalized distribution: (4/9, 3/9, 2/9), 7/9 < 0.8 keeps all three
    torch.testing.assert_close(p[4], torch.tensor([4 / 9, 3 / 9, 2 / 9, 0]))
    ties = torch.tensor([[[1.0, 2.0, 2.0, 0.0]]])
    p = target_probs(ties, torch.ones(1), torch.tensor([1], dtype=torch.int32), torch.ones(1))
    assert torch.equal(p[0, 0] > 0, torch.tensor([False, True, True, False])), "ties kept together"
    hot = target_probs(torch.tensor([[[0.5, 3.0, -1.0]]]), torch.tensor([0.0]), torch.zeros(1, dtype=torch.int32),
                       torch.ones(1), has_filters=False)
    assert torch.equal(hot[0, 0], torch.tensor([0.0, 1.0, 0.0]))
    temp = target_probs(logits[:1], torch.tensor([0.5]), torch.zeros(1, dtype=torch.int32), torch.ones(1))
    torch.testing.assert_close(temp[0, 0], torch.tensor([16, 9, 4, 1]) / 30.0)


# ----------------------------------------------------------------------------- rejection sampling


def rejection_oracle(p, drafts, q, seeds, positions):
    """Row by row, position by position, straight from the algorithm's definition."""
    B, k1, V = p.shape
    k = k1 - 1
    out = torch.full((B, k1), -1, dtype=torch.int64)
    acc = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        seed = seeds[b : b + 1]
        for j in range(k1):
            P = positions[b : b + 1] + j
            if j == k:
                noise = rng.exponential(seed, P, V, rng.STREAM_SAMPLE)[0]
                out[b, j] = int(torch.argmax(p[b, j] / noise))
                break
            x = int(drafts[b, j])
            qx = 1.0 if q is None else q[b, j, x]
            u = rng.uniform(seed, P, 1, rng.STREAM_ACCEPT)[0, 0]
            if u * qx < p[b, j, x]:
                out[b, j] = x
                acc[b] += 1
                continue
            qj = torch.nn.functional.one_hot(torch.tensor(x), V).float() if q is None else q[b, j]
            resid = (p[b, j] - qj).clamp_min(0)
            if q is None:
                resid[x] = 0.0
            if not (resid > 0).any():
                resid = p[b, j]
            noise = rng.exponential(seed, P, V, rng.STREAM_RESIDUAL)[0]
            out[b, j] = int(torch.argmax(resid / noise))
            break
    return out, acc


def rejection_case(B, k, V, seed, with_q=True, filters=False):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, k + 1, V, generator=gen) * 2
    q = torch.softmax(torch.randn(B, k, V, generator=gen) * 2, -1) if with_q else None
    if q is not None:
        drafts = torch.multinomial(q.view(-1, V), 1, generator=gen).view(B, k)
    else:
        drafts = torch.randint(0, V, (B, k), generator=gen)
    # make some drafts the target's favourite so acceptance runs are long
    fav = torch.rand(B, k, generator=gen) < 0.5
    drafts = torch.where(fav, logits[:, :k].argmax(-1), drafts)
    temperature = torch.rand(B, generator=gen) * 1.5 + 0.3
    temperature[::4] = 0.0
    top_k = torch.zeros(B, dtype=torch.int32)
    top_p = torch.ones(B)
    if filters:
        top_k = torch.randint(0, V + 2, (B,), generator=gen, dtype=torch.int32)
        top_p = torch.where(torch.rand(B, generator=gen) < 0.5, torch.rand(B, generator=gen), torch.ones(B))
    seeds = torch.randint(-(2**62), 2**62, (B,), generator=gen)
    positions = torch.randint(0, 5000, (B,), generator=gen)
    return logits, drafts, q, temperature, top_k, top_p, seeds, positions


@pytest.mark.parametrize("with_q", [True, False])
@pytest.mark.parametrize("k", [0, 1, 2, 4, 8])
def test_rejection_ref_matches_oracle(with_q, k):
    args = rejection_case(6, k, 50, seed=k + 10 * with_q, with_q=with_q, filters=True)
    out, acc = verify_rejection_ref(*args)
    p = target_probs(args[0], args[3], args[4], args[5])
    want_out, want_acc = rejection_oracle(p, args[1], args[2], args[6], args[7])
    assert torch.equal(out, want_out) and torch.equal(acc, want_acc)


REJECTION_SHAPES = [(3, 37, None, k) for k in (0, 1, 2, 3, 4, 5, 6, 7, 8)]
REJECTION_SHAPES += [(4, 300, 64, k) for k in (1, 4, 8)] + [(2, 1000, None, k) for k in (2, 5)]


@pytest.mark.parametrize("with_q", [True, False])
@pytest.mark.parametrize("B,V,chunk,k", REJECTION_SHAPES)
def test_rejection_triton_equals_ref(with_q, B, V, chunk, k):
    args = rejection_case(B, k, V, seed=k * 7 + V + with_q, with_q=with_q, filters=(k % 2 == 1))
    want = verify_rejection_ref(*args)
    got = verify_rejection_triton(*args, chunk=chunk)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(verify_rejection(*args)[0], want[0])


def test_rejection_batch_invariance():
    """A row's tokens depend on its own seed and positions only, not on its batch neighbours."""
    args = rejection_case(6, 3, 64, seed=3)
    full = verify_rejection_ref(*args)
    sub = verify_rejection_ref(*[a[2:4] if a is not None else None for a in args])
    assert torch.equal(full[0][2:4], sub[0])


# chi-square: (p, q) pairs with q None (one-hot on a fixed draft token), q with zeros where p is
# not, p with zeros where q is not, and q equal to p (always accepted)
DIST_CASES = [
    ([0.5, 0.2, 0.2, 0.1, 0.0], None, 0),
    ([0.5, 0.2, 0.2, 0.1, 0.0], None, 4),
    ([0.1, 0.2, 0.3, 0.4, 0.0], [0.0, 0.0, 0.5, 0.0, 0.5], None),
    ([0.0, 0.5, 0.0, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25, 0.0], None),
    ([0.3, 0.3, 0.2, 0.1, 0.1], [0.3, 0.3, 0.2, 0.1, 0.1], None),
]


def _first_token_counts(fn, p, q, draft_token, n, k=2):
    V = len(p)
    gen = torch.Generator().manual_seed(1234)
    pt = torch.tensor(p)
    logits = torch.log(pt).expand(n, k + 1, V).contiguous()
    if q is None:
        drafts = torch.full((n, k), draft_token, dtype=torch.int64)
        draft_probs = None
    else:
        qt = torch.tensor(q)
        drafts = torch.multinomial(qt, n * k, replacement=True, generator=gen).view(n, k)
        draft_probs = qt.expand(n, k, V).contiguous()
    out, _ = fn(logits, drafts, draft_probs, torch.ones(n), torch.zeros(n, dtype=torch.int32), torch.ones(n),
                torch.arange(n, dtype=torch.int64) * 7919 + 17, torch.full((n,), 11, dtype=torch.int64))
    return torch.bincount(out[:, 0].cpu(), minlength=V).numpy(), pt.numpy()


def _assert_distribution(counts, p):
    n = counts.sum()
    support = p > 0
    assert counts[~support].sum() == 0, f"sampled tokens outside the support of p: {counts}"
    expected = p[support].astype(np.float64)
    stat = chisquare(counts[support], expected / expected.sum() * n)
    assert stat.pvalue > 1e-3, (counts, p * n, stat)


@pytest.mark.parametrize("p,q,draft_token", DIST_CASES)
def test_rejection_distribution_ref(p, q, draft_token):
    _assert_distribution(*_first_token_counts(verify_rejection_ref, p, q, draft_token, 20000))


@pytest.mark.gpu
@pytest.mark.parametrize("p,q,draft_token", DIST_CASES)
def test_rejection_distribution_triton_cuda(p, q, draft_token):
    """On CPU the Triton path is covered by exact equality with the reference (the interpreter is
    too slow for 20k rows); on a GPU it also gets the distribution check directly."""
    def on_cuda(*args):
        return verify_rejection_triton(*[a.cuda() if a is not None else None for a in args])
    counts, p = _first_token_counts(on_cuda, p, q, draft_token, 20000)
    _assert_distribution(counts, p)


def test_rejection_distribution_with_filters():
    """With top-k and top-p on, the first token follows the filtered, renormalized p."""
    V, n = 6, 20000
    p = torch.tensor([0.3, 0.25, 0.2, 0.15, 0.06, 0.04])
    logits = torch.log(p).expand(n, 2, V).contiguous()
    drafts = torch.full((n, 1), 5, dtype=torch.int64)  # outside the kept set: always rejected
    out, acc = verify_rejection_ref(
        logits, drafts, None, torch.ones(n), torch.full((n,), 4, dtype=torch.int32), torch.full((n,), 0.7),
        torch.arange(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64))
    assert int(acc.sum()) == 0
    kept = np.array([0.3, 0.25, 0.2, 0.0, 0.0, 0.0])  # top-4 renormalized is (.33,.28,.22,.17); 0.61 < 0.7
    _assert_distribution(np.bincount(out[:, 0].numpy(), minlength=V), kept / kept.sum())


@pytest.mark.gpu
@pytest.mark.parametrize("with_q", [True, False])
@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("V", [32000, 128256])
def test_verify_cuda(with_q, k, V):
    args = rejection_case(8, k, V, seed=k, with_q=with_q, filters=True)
    cuda = [a.cuda() if a is not None else None for a in args]
    want = verify_rejection_ref(*args)
    got = verify_rejection_triton(*cuda)
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    want = verify_greedy_ref(args[0], args[1])
    got = verify_greedy_triton(cuda[0], cuda[1])
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
