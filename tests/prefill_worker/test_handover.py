"""Prefill (tp=1, in this process) -> decode group (tp=2 rank actors): each rank receives exactly its
KV-head slice of the prefill's blocks, byte for byte, for odd block counts; then decodes what the
single-process engine decodes."""
from __future__ import annotations

import asyncio

import pytest
import torch

from cluster.placement import RankResources
from cluster.protocol import PrefillRequest
from cluster.settings import EngineSettings
from decode_worker.controller import DecodeController
from decode_worker.group import GroupSpec, RankGroup
from engine import EngineConfig, LLMEngine, SamplingParams
from prefill_worker.deployment import PrefillServer

pytestmark = pytest.mark.ray

BLOCK = 16


def reference_blocks(model_dir: str, prompt: list[int]) -> torch.Tensor:
    """[L, 2, n, S, H, D] KV of the prompt's blocks from an independent single-process prefill."""
    eng = LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=64, block_size=BLOCK))
    eng.add_request("ref", prompt, SamplingParams(max_tokens=4, temperature=0.0), prefill_only=True)
    while eng.has_unfinished():
        eng.step()
    h = eng.take_handover("ref")
    n = -(-h.request.num_computed_tokens // BLOCK)
    return eng.kv_cache[:, :, h.block_ids[:n]].clone()


def test_tp1_prefill_hands_each_tp2_rank_its_head_slice(ray_session, tiny_model_dir):
    async def main():
        spec = GroupSpec(engine=EngineSettings(model=tiny_model_dir, num_kv_blocks=64, block_size=BLOCK),
                         tp_size=2, resources=RankResources(num_cpus=1))
        group = await RankGroup.start(spec)
        prefill = PrefillServer({"model": tiny_model_dir, "num_kv_blocks": 64, "block_size": BLOCK})
        ctrl = DecodeController(tp_size=2)
        try:
            results = {}
            for n_tokens in (10, 40, 70):  # 1, 3 and 5 blocks
                prompt = [(7 * i + n_tokens) % 300 + 3 for i in range(n_tokens)]
                rid = f"r{n_tokens}"
                sink: asyncio.Queue = asyncio.Queue()
                ctrl.expect(rid, sink)
                request = PrefillRequest(rid, tuple(prompt), SamplingParams(max_tokens=6, temperature=0.0,
                                                                            ignore_eos=True))
                first = await anext(prefill.prefill(request.to_wire(), group.target))
                for _ in range(2000):  # steps long-poll 50 ms for hand-over events; this bounds a hang
                    if ctrl.requests[rid].phase.value == "running":
                        break
                    ctrl.on_reports(await group.step(ctrl.next_step(), 0.05))
                else:
                    raise AssertionError(f"the hand-over of {rid} did not land")
                slices = [await r.kv_blocks.remote(rid) for r in group.ranks]
                tokens = list(first.token_ids)
                while rid in ctrl.requests:
                    ctrl.on_reports(await group.step(ctrl.next_step(), 0.0))
                while not sink.empty():
                    tokens += sink.get_nowait().token_ids
                results[n_tokens] = (prompt, slices, tokens, [r.kv_heads for r in group.target.ranks])
            return results
        finally:
            prefill.loop.stop()
            group.kill()

    results = asyncio.run(main())
    from engine import LLM

    llm = LLM(tiny_model_dir, num_kv_blocks=64, block_size=BLOCK)
    for n_tokens, (prompt, slices, tokens, heads) in results.items():
        ref = reference_blocks(tiny_model_dir, prompt)
        assert ref.shape[2] == -(-n_tokens // BLOCK)
        assert heads == [(0, 1), (1, 1)]
        for (start, count), got in zip(heads, slices):
            want = ref[:, :, :, :, start:start + count]
            assert got.shape == want.shape
            assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))
        want_tokens = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
        assert tokens == want_tokens.token_ids


def test_hand_overs_to_a_dead_group_fail_at_once_and_given_up_ones_are_dropped(ray_session, tiny_model_dir):
    """The sender has one thread: a group whose ranks died must not make every hand-over queued for it wait out
    a connect timeout (30 s each, seen under resumption: the resumed requests' hand-overs queued behind them), and
    a hand-over its router gave up on is not sent at all."""
    from cluster.errors import ChannelError

    async def main():
        spec = GroupSpec(engine=EngineSettings(model=tiny_model_dir, num_kv_blocks=64, block_size=BLOCK),
                         tp_size=1, resources=RankResources(num_cpus=1))
        group = await RankGroup.start(spec)
        group.kill()
        prefill = PrefillServer({"model": tiny_model_dir, "num_kv_blocks": 64, "block_size": BLOCK,
                                 "connect_timeout_s": 30.0})
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        try:
            reasons = []
            for rid in ("a", "b"):
                stream = prefill.prefill(PrefillRequest(rid, (5, 6, 7, 8), params).to_wire(), group.target)
                await anext(stream)
                with pytest.raises(ChannelError) as e:
                    await anext(stream)
                reasons.append(str(e.value.__cause__))
            # A hand-over whose caller stopped waiting (the stream closed after its first token) is dropped.
            before = prefill.loop.sender.dropped
            stream = prefill.prefill(PrefillRequest("c", (5, 6, 7, 8), params).to_wire(), group.target)
            await anext(stream)
            task = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0)
            task.cancel()
            for _ in range(200):
                if prefill.loop.sender.dropped > before or prefill.loop.sender.failures > 2:
                    break
                await asyncio.sleep(0.05)
            for _ in range(200):  # the release reaches the engine on its own thread
                if not prefill.engine.blocks.pool.num_used:
                    break
                await asyncio.sleep(0.05)
            return reasons, prefill.loop.sender.dropped - before, prefill.engine.blocks.pool.num_used
        finally:
            prefill.loop.stop()

    reasons, dropped, used = asyncio.run(main())
    # The first found the rank's actor dead (no connect attempt, no 30 s timeout); the second did not even ask.
    assert "decode rank 0 of group" in reasons[0] and reasons[0].endswith("is gone"), reasons
    assert reasons[1] == f"decode group {reasons[0].split()[5]} is gone", reasons
    assert used == 0
    assert dropped in (0, 1)  # 1 unless the sender reached it before the cancel (then it failed fast instead)
