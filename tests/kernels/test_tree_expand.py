"""kernels/tree_expand.py: one depth of a draft tree's expansion, the Triton kernel (interpreted here) equal to its
torch reference, and the reference equal to what it stands for: the acceptance table's cells and scores
(engine/speculative/tree_score.py), cumulative scores, forced flags and the K best by a stable sort."""
import pytest
import torch

from engine.speculative.tree_score import NUM_BUCKETS, AcceptanceTable
from kernels.tree_expand import expand_depth, expand_depth_ref, expand_depth_triton


def _case(B: int, R: int, K: int, D: int, table: bool, remap: bool, seed: int, child: bool = False):
    """Random candidates as an expansion makes them: each row a descending top-K of a log-softmax, some rows masked
    (one with a forced token and -inf siblings, one closed entirely), ties across rows; child: guided, some rows with a
    grammar-forced child handed over as a target id (one inside the draft vocabulary, one outside it, whose masked
    row admits nothing)."""
    g = torch.Generator().manual_seed(seed)
    Vd = 40
    logits = torch.randn(B, R, Vd, generator=g) * 2
    lp, ids = logits.log_softmax(-1).topk(K, dim=-1)
    masked = torch.rand(B, R, generator=g) < 0.4
    if R > 1:
        lp[0, 1] = float("-inf")  # a forced row: one admissible token, probability 1
        lp[0, 1, 0] = 0.0
        masked[0, 1] = True
        lp[B - 1, 0] = float("-inf")  # a row the grammar closed
        masked[B - 1, 0] = True
        lp[B - 1, R - 1] = lp[B - 1, R - 2]  # equal scores in two rows: the lower index must win
    args = dict(
        log_probs=lp, draft_ids=ids,
        parent_score=(-torch.rand(B, R, generator=g) * 3) if R > 1 else None,
        parent_candidate=(torch.arange(R)[None].expand(B, R) * 3 + 1) if R > 1 else None,
        masked=masked, sampled=torch.rand(B, generator=g) < 0.5,
        log_rate=(torch.rand(4 * K * NUM_BUCKETS, generator=g) * 0.98 + 0.01).log() if table else None,
        num_buckets=NUM_BUCKETS, remap=torch.randperm(1000, generator=g)[:Vd] if remap else None,
        path=torch.randint(0, 1000, (B, R, D), generator=g) if D else None,
        lineage=torch.randint(0, 1 << 20, (B, R), generator=g) if R > 1 else None, offset=7,
        own_shift=D * K, span=(D + 1) * K)  # the depth after the path's: its rows' bits and the window they see
    if R > 1:
        args["parent_score"][B - 1, R - 1] = args["parent_score"][B - 1, R - 2]
    if child:
        forced = torch.full((B, R), -1)
        forced[0, 0] = 2000 + seed  # outside the draft vocabulary: its row closed by the mask
        lp[0, 0], masked[0, 0] = float("-inf"), True
        if R > 1:  # the in-vocabulary forced row above, its token handed over too
            forced[0, 1] = int(args["remap"][ids[0, 1, 0]]) if remap else int(ids[0, 1, 0])
        args["forced_child"] = forced
    return args


CASES = [  # (B, R, K, D): the root (one row), middle depths, the widest expansion (8 x 8 = 64 candidates)
    (3, 1, 2, 0), (3, 1, 8, 0), (2, 2, 2, 1), (3, 4, 4, 3), (2, 8, 8, 7), (1, 3, 3, 2)]


@pytest.mark.parametrize("B,R,K,D", CASES)
@pytest.mark.parametrize("table,remap,child", [(True, True, False), (False, False, False), (True, False, False),
                                               (True, True, True), (False, False, True)])
def test_triton_equals_reference(B, R, K, D, table, remap, child):
    args = _case(B, R, K, D, table, remap, seed=B * 100 + R * 10 + K, child=child)
    ref, tri = expand_depth_ref(**args), expand_depth_triton(**args)
    for name, a, b in zip(ref._fields, ref, tri):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
        else:
            assert torch.equal(a, b), name


@pytest.mark.parametrize("B,R,K,D", [(3, 1, 4, 0), (3, 4, 4, 3), (2, 8, 8, 7)])
def test_candidates_written_into_the_expansion_columns(B, R, K, D):
    """With `out` (the whole expansion's [B, C] fields) each depth writes its candidates at columns offset.., the
    kernel as the reference, and leaves the other columns alone."""
    args = _case(B, R, K, D, True, True, seed=5 + D)
    M, C = R * K, R * K + 11
    offset = args["offset"]
    if offset + M > C - 3:
        args["offset"] = offset = 4
    for fn in (expand_depth_ref, expand_depth_triton):
        out = (torch.full((B, C), -7.0), torch.full((B, C), -7), torch.zeros((B, C), dtype=torch.bool),
               torch.full((B, C), -7), torch.full((B, C), -7))
        alone, into = fn(**args), fn(**args, out=out)
        for name, a, b, buf in zip(alone._fields, alone, into, out):
            assert torch.equal(a, b), (fn.__name__, name)
            assert torch.equal(buf[:, offset: offset + M], a), (fn.__name__, name)
            rest = torch.cat([buf[:, :offset], buf[:, offset + M:]], 1)
            assert (rest == (False if buf.dtype == torch.bool else -7)).all(), (fn.__name__, name)


def test_reference_is_the_table_the_cumulative_score_and_a_stable_top_k():
    B, R, K = 2, 4, 4
    args = _case(B, R, K, 2, True, True, seed=3)
    table = AcceptanceTable(K, torch.device("cpu"))
    table.load(table.trials, table.trials * torch.rand(table.trials.shape, generator=torch.Generator().manual_seed(1)))
    args["log_rate"] = table.rates().flatten().clamp(min=1e-6).log()
    out = expand_depth(**args)
    lp, masked = args["log_probs"], args["masked"]
    cells = table.cells(lp, torch.arange(K), args["sampled"], masked[..., None])
    own = table.score(lp, cells)
    assert torch.equal(out.cells, cells.reshape(B, R * K))
    torch.testing.assert_close(out.scores, (own + args["parent_score"][..., None]).reshape(B, R * K))
    assert torch.equal(out.forced, ((lp == 0) & masked[..., None]).reshape(B, R * K))
    assert out.forced[0, K] and not out.forced[0, K + 1]  # row 1 of request 0: its forced token, not the -inf
    assert torch.equal(out.tokens, args["remap"][args["draft_ids"]].reshape(B, R * K))
    assert torch.equal(out.parents, args["parent_candidate"].repeat_interleave(K, 1))
    for b in range(B):
        order = sorted(range(R * K), key=lambda m: (-out.scores[b, m].item(), m))[:K]
        assert out.candidate[b].tolist() == [7 + m for m in order]
        assert out.lane[b].tolist() == [m // K for m in order]
        assert out.best[b].tolist() == [out.scores[b, m].item() for m in order]
        for i, m in enumerate(order):
            assert out.path[b, i].tolist() == args["path"][b, m // K].tolist() + [out.tokens[b, m].item()]
            own = 1 << (args["own_shift"] + i)  # the next frontier's row i sits at own_shift + i
            assert out.lineage[b, i] == args["lineage"][b, m // K] | own
            # window_bits: the lineage moved to the top of the 64-position window, everything before the span seen
            below = 64 - args["span"]
            bits = ((out.lineage[b, i].item() << below) | ((1 << below) - 1)) & ((1 << 64) - 1)
            assert out.tree_mask[b, i].item() == bits - (1 << 64 if bits >> 63 else 0)  # as int64


@pytest.mark.parametrize("remap", [True, False])
def test_a_forced_child_is_its_rows_only_candidate_in_vocabulary_or_not(remap):
    """A row with a forced child (forced_child, a target id) proposes it first, of probability 1 (score 0 plus its
    parent's, never a table estimate), flagged forced, its siblings -inf; a child outside the draft vocabulary (its
    masked row all -inf) the same; rows without one are as without forced children."""
    B, R, K = 2, 3, 4
    args = _case(B, R, K, 2, True, remap, seed=11, child=True)
    out = expand_depth_ref(**args)
    plain = expand_depth_ref(**{**args, "forced_child": None})
    fc = args["forced_child"]
    for b in range(B):
        for r in range(R):
            cols = slice(r * K, (r + 1) * K)
            if fc[b, r] < 0:
                for name in ("scores", "cells", "forced", "tokens"):
                    assert torch.equal(getattr(out, name)[b, cols], getattr(plain, name)[b, cols]), (b, r, name)
                continue
            assert out.tokens[b, r * K] == fc[b, r] and out.forced[b, r * K] and out.cells[b, r * K] == -1
            assert out.scores[b, r * K] == args["parent_score"][b, r]
            assert torch.isneginf(out.scores[b, r * K + 1: (r + 1) * K]).all()
            assert not out.forced[b, r * K + 1: (r + 1) * K].any()
    assert out.tokens[0, 0] == 2011  # outside the draft vocabulary (40 ids; a remap's targets below 1000)


def test_without_a_table_a_candidate_scores_its_log_probability():
    args = _case(2, 1, 4, 0, False, False, seed=5)
    out = expand_depth_ref(**args)
    assert (out.cells == -1).all() and (out.parents == -1).all()
    assert out.lineage.tolist() == [[1, 2, 4, 8]] * 2  # the root's frontier: depth-1 rows at offsets 0..3
    torch.testing.assert_close(out.scores, args["log_probs"].reshape(2, 4))
    assert torch.equal(out.path[:, :, 0], out.next_tokens)


def _candidates(B: int, K: int, k: int, seed: int):
    """A whole expansion's candidates (expand's layout: K at depth 1, then K * K per depth, each depth's parents
    among the previous depth's K best), scores cumulative (a child never above its parent), with ties: a forced
    child scoring as its parent, and -inf candidates."""
    g = torch.Generator().manual_seed(seed)
    scores, parents = [-torch.rand(B, K, generator=g)], [torch.full((B, K), -1)]
    frontier = torch.arange(K).expand(B, K)
    offset, depths = K, [1] * K
    for d in range(1, k):
        par = frontier.repeat_interleave(K, 1)  # [B, K*K] candidate index of each child's parent
        own = -torch.rand(B, K * K, generator=g) * 2
        own[:, ::K] = torch.where(torch.rand(B, K, generator=g) < 0.3, 0.0, own[:, ::K])  # forced: parent's score
        own[:, K - 1::K] = torch.where(torch.rand(B, K, generator=g) < 0.3, float("-inf"), own[:, K - 1::K])
        s = torch.cat(scores, 1).gather(1, par) + own
        scores.append(s)
        parents.append(par)
        frontier = offset + torch.sort(s, dim=1, descending=True, stable=True).indices[:, :K]
        offset += K * K
        depths += [d + 1] * (K * K)
    scores, parents = torch.cat(scores, 1), torch.cat(parents, 1)
    C = scores.shape[1]
    return dict(tokens=torch.randint(0, 5000, (B, C), generator=g), scores=scores, parents=parents,
                depths=torch.tensor(depths), cells=torch.randint(-1, 100, (B, C), generator=g),
                forced=torch.rand(B, C, generator=g) < 0.2)


@pytest.mark.parametrize("B,K,k,n", [(2, 2, 3, 4), (3, 4, 3, 8), (2, 8, 4, 16), (1, 4, 8, 8), (2, 8, 8, 63),
                                     (2, 2, 8, 8)])
def test_choose_triton_equals_reference(B, K, k, n):
    from kernels.tree_expand import choose_ref, choose_triton

    args = _candidates(B, K, k, seed=B + K * 10 + k * 100)
    for max_depth in (k, None):
        for extra, table in ((True, True), (False, True), (True, False)):
            # depths from the candidates' table, or (None) from the chosen nodes' parents: the same depths
            kw = dict(args) if extra else dict(args, cells=None, forced=None)
            kw = kw if table else dict(kw, depths=None)
            ref = choose_ref(**kw, n=n, max_depth=max_depth)
            if not table:
                assert torch.equal(ref.depth, choose_ref(**dict(kw, depths=args["depths"]), n=n,
                                                         max_depth=max_depth).depth)
            if extra:
                want = (ref.forced.long() << torch.arange(n)).sum(1)
                assert torch.equal(ref.forced_word, want) and (want != 0).any()
            tri = choose_triton(kw["tokens"], kw["scores"], kw["parents"], kw["depths"], n, kw["cells"],
                                kw["forced"], max_depth)
            for name, a, b in zip(ref._fields, ref, tri):
                assert (a is None) == (b is None), name
                if a is not None:
                    assert a.dtype == b.dtype and torch.equal(a, b), name
            assert (ref.parents < torch.arange(1, n + 1)).all()  # each node after its parent


@pytest.mark.gpu
@pytest.mark.parametrize("B,R,K,D", [(3, 1, 4, 0), (2, 8, 8, 7), (64, 4, 4, 3)])
def test_on_a_gpu_both_kernels_equal_the_cpu_references(B, R, K, D):
    args = _case(B, R, K, D, True, True, seed=11)
    ref = expand_depth_ref(**args)
    got = expand_depth(**{k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()})
    for name, a, b in zip(ref._fields, ref, got):
        assert torch.equal(a, b.cpu()) if not a.is_floating_point() else torch.allclose(a, b.cpu(), atol=1e-6), name
    from kernels.tree_expand import choose, choose_ref

    cands = _candidates(B, K, 8, seed=12)
    want = choose_ref(**cands, n=min(63, K * 8), max_depth=8)
    got = choose(**{k: v.cuda() for k, v in cands.items()}, n=min(63, K * 8), max_depth=8)
    for name, a, b in zip(want._fields, want, got):
        assert torch.equal(a, b.cpu()), name
