"""Guided steps through the graph path (engine/masking/graph.py): the grammar fills run as host functions
between the step's kernels, staged through host buffers. On CPU the same order runs in place (the padded
graph layout without capture); on a GPU the step is captured and replayed many times. Either way the
tokens must equal the eager guided step's, sampled rows included (same seeds, same masked
distributions), and every guided output must be complete and valid."""
from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.masking.host_func import HostFunctionError, HostFunctions
from tests.support.guided import guided_batch, is_valid
from tests.support.spec import spec_config, use_graphs


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread_module):
    """Tiny models: one intra-op thread (tests/engine/conftest.py)."""


def _check(outs, ref, kinds, llm):
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    for o, kind in zip(outs, kinds):
        if kind is not None:
            assert o.finish_reason == "stop" and is_valid(kind, o.text), (kind, o.text)
    assert llm.engine.stats()["kv_blocks_used"] == 0 and not llm.engine.guided.grammar.states


@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_guided_steps_through_the_padded_graph_layout_equal_eager(llama_dir, spec_drafts, method):
    prompts, params, kinds = guided_batch(8)
    spec = spec_config(method, 3, spec_drafts, llama_dir)
    kw = dict(num_kv_blocks=512, block_size=4, speculative=spec)
    ref = LLM(llama_dir, **kw).generate(prompts, params)
    llm = LLM(llama_dir, **kw)
    graphs = use_graphs(llm, capture=False)
    outs = llm.generate(prompts, params)
    masked_runs = [key for key in graphs.captured if key[2]]
    assert masked_runs and graphs.num_runs > 2, "guided decode steps went through the graph path"
    _check(outs, ref, kinds, llm)


def test_staged_tree_fills_hand_the_masker_host_copies():
    """StagedMasker's draft tree fills (the captured step's): the parents, emitted tokens, accepted counts and paths the
    real masker gets are host copies equal to the step's tensors, in the fill's own shapes (the root expansion's
    empty paths too, and batches smaller than the buffers), and what it writes comes back as the step's bitmask,
    flags and forced children, the rows it leaves unflagged cleared of an earlier fill's flags and forced tokens."""
    from engine.masking.graph import StagedMasker
    from engine.masking.masker import LogitsMasker
    from engine.speculative.tree import TreeShape

    class Recording(LogitsMasker):
        def __init__(self):
            self.seen = []

        def begin_step(self, rows):
            return True

        def fill_verify(self, bitmask, flags):
            raise AssertionError("a tree step fills its trees' rows")

        def fill_draft(self, *args):
            raise AssertionError("a tree step fills its trees' rows")

        def fill_verify_tree(self, bitmask, flags, parents):
            self.seen.append(("verify", parents.clone()))
            bitmask[:, 1] = 5
            flags[:, 1] = True

        def fill_draft_tree(self, emitted, num_accepted, paths, bitmask, flags, forced):
            assert (forced == -1).all(), "every fill starts with no forced child"
            self.seen.append(("draft", emitted.clone(), num_accepted.clone(), paths.clone()))
            bitmask[0, -1] = paths.shape[2] + 1
            flags[0, -1] = True
            forced[0, -1] = 40 + paths.shape[2]

    shape = TreeShape(topk=3, depth=3, num_nodes=5)
    staged = StagedMasker(torch.device("cpu"), max_batch=4, k=5, vocab_size=100, tree=shape)
    recording = Recording()
    staged.bind(recording)
    B, W = 2, 4  # fewer requests than the buffers hold
    parents = torch.tensor([[0, 0, 1, 1, 3], [0, 1, 2, 0, 4]])
    bits, flags = torch.zeros((B, 6, W), dtype=torch.int32), torch.ones((B, 6), dtype=torch.bool)
    staged.fill_verify_tree(bits, flags, parents)
    assert flags[:, 1].all() and not flags[:, 0].any() and not flags[:, 2:].any() and (bits[:, 1] == 5).all()
    emitted, accepted = torch.tensor([[7, 8, -1, -1], [9, -1, -1, -1]]), torch.tensor([1, 0])
    for paths in (torch.zeros((B, 1, 0), dtype=torch.int64), torch.arange(6).view(B, 3, 1),
                  torch.arange(12).view(B, 3, 2)):
        L, d = paths.shape[1:]
        bits, flags = torch.zeros((B, L, W), dtype=torch.int32), torch.zeros((B, L), dtype=torch.bool)
        forced = torch.full((B, L), 7, dtype=torch.int64)  # whatever the step's buffer held before
        staged.fill_draft_tree(emitted, accepted, paths, bits, flags, forced)
        assert flags.tolist() == [[False] * (L - 1) + [True], [False] * L] and int(bits[0, -1, 0]) == d + 1
        assert forced.tolist() == [[-1] * (L - 1) + [40 + d], [-1] * L]
    staged.finish()
    assert recording.seen[0][0] == "verify" and torch.equal(recording.seen[0][1], parents)
    assert [s[3].shape for s in recording.seen[1:]] == [(B, 1, 0), (B, 3, 1), (B, 3, 2)]
    for _, e, a, paths in recording.seen[1:]:
        assert torch.equal(e, emitted) and torch.equal(a, accepted)
    assert torch.equal(recording.seen[3][3], torch.arange(12).view(B, 3, 2))


def test_staged_chain_fills_hand_back_the_forced_drafts():
    """StagedMasker's chain draft fill: the forced token the real masker writes comes back as the step's `forced`,
    every other row -1 (not what the step's buffer or an earlier fill held)."""
    from engine.masking.graph import StagedMasker
    from engine.masking.masker import LogitsMasker

    class Forcing(LogitsMasker):
        def begin_step(self, rows):
            return True

        def fill_verify(self, bitmask, flags):
            pass

        def fill_draft(self, step, emitted, num_accepted, drafts, bitmask, flags, forced):
            assert (forced == -1).all() and len(drafts) == step
            forced[step % 2] = 100 + step
            flags[step % 2] = True

    staged = StagedMasker(torch.device("cpu"), max_batch=4, k=3, vocab_size=200)
    staged.bind(Forcing())
    emitted, accepted = torch.tensor([[5, -1, -1, -1], [6, 7, -1, -1]]), torch.tensor([0, 1])
    drafts = []
    for step in range(3):
        bits, flags = torch.zeros((2, 7), dtype=torch.int32), torch.zeros(2, dtype=torch.bool)
        forced = torch.full((2,), 9, dtype=torch.int64)
        staged.fill_draft(step, emitted, accepted, drafts, bits, flags, forced)
        staged.host.sync()
        expected = [-1, -1]
        expected[step % 2] = 100 + step
        assert forced.tolist() == expected and flags.tolist() == [i == step % 2 for i in range(2)]
        drafts.append(forced.clone())
    staged.finish()


def test_a_failing_host_function_fails_the_step_after_it_ran():
    host = HostFunctions(torch.device("cpu"))
    ran = []
    host.launch(lambda: ran.append(1))
    host.launch(lambda: 1 / 0)
    host.launch(lambda: ran.append(2))  # later host functions still run; the first error is kept
    with pytest.raises(HostFunctionError, match="ZeroDivisionError"):
        host.sync()
    assert ran == [1, 2]
    host.sync()  # reported once


def test_a_host_function_writes_inference_tensors_from_another_thread():
    """CUDA runs host functions on a driver thread, outside the step's inference mode: writing the step's
    buffers (inference tensors) must still work there."""
    import threading

    with torch.inference_mode():
        flags = torch.ones(4, dtype=torch.int32)
    host = HostFunctions(torch.device("cpu"))
    worker = threading.Thread(target=host._run, args=(flags.zero_,))
    worker.start()
    worker.join()
    host.check()
    assert int(flags.sum()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_captured_guided_step_replays_equal_eager(llama_dir, spec_drafts, method):
    """The captured step with host-function mask fills, replayed for many steps and padded sizes, gives
    the eager guided step's tokens (cuda-python#790 reported captured host functions running only on the
    first replay: this would catch it)."""
    prompts, params, kinds = guided_batch(8)
    spec = spec_config(method, 3, spec_drafts, llama_dir)
    kw = dict(device="cuda", dtype="float32", num_kv_blocks=512, block_size=4, max_num_seqs=16, speculative=spec)
    ref = LLM(llama_dir, cuda_graphs=False, **kw).generate(prompts, params)
    # the eager CUDA steps on their own (prefills and trimmed verification are eager with graphs too): the bitmask
    # kernel once read a trimmed step's column-0 flags as contiguous and left a first token unmasked
    for o, kind in zip(ref, kinds):
        if kind is not None:
            assert o.finish_reason == "stop" and is_valid(kind, o.text), (kind, o.text)
    llm = LLM(llama_dir, **kw)
    outs = llm.generate(prompts, params)
    graphs = llm.engine.runner.graphs
    masked = [cuda for key, cuda in graphs.captured.items() if key[2]]
    assert masked and all(masked), "guided steps replayed captured graphs"
    assert graphs.num_runs > 10
    _check(outs, ref, kinds, llm)


@pytest.mark.gpu
def test_a_captured_host_function_runs_on_every_replay():
    host = HostFunctions(torch.device("cuda"))
    counter = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    out = torch.zeros(1, dtype=torch.int64, device="cuda")

    def step():
        host.launch(lambda: counter.add_(1))
        out.copy_(counter, non_blocking=True)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up, eager
    torch.cuda.current_stream().wait_stream(stream)
    host.sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for i in range(50):
        graph.replay()
        host.sync()
        assert int(counter) == i + 2 and int(out.item()) == i + 2
