"""PrefillServer: the prefill Serve deployment. One engine per replica runs prompts in batches,
samples each one's first token, and hands the KV over to the decode group the router chose."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import uuid
from typing import AsyncIterator

import torch

from cluster.errors import ChannelError
from cluster.faults import FaultPoints
from cluster.protocol import DecodeTarget, KVLayout, ModelInfo, PrefillRequest, PrefillResult
from cluster.prefix_view import PrefixView
from cluster.protocol.load import PrefillLoad, prefix_cache_counts
from cluster.runtime import replica_id
from engine import LLMEngine
from prefill_worker.config import PrefillConfig
from prefill_worker.loop import PrefillLoop

log = logging.getLogger(__name__)


class PrefillServer:
    def __init__(self, config: PrefillConfig | dict):
        self.config = config if isinstance(config, PrefillConfig) else PrefillConfig(**config)
        c = self.config
        if c.torch_threads and not c.device.startswith("cuda"):
            torch.set_num_threads(c.torch_threads)
        # The router detokenizes and applies stops. cpu_compile is a decode setting: a prefill's forwards are
        # prompt-sized, past the row buckets compiled code serves (engine/layers/cpu_compile.py); so is adaptive k's
        # start-up cost probe (engine/runner/cost_probe.py), which times decode steps.
        spec = c.speculative and {**c.speculative, "cost_probe": False}
        self.engine = LLMEngine(c.engine_config(detokenize=False, cpu_compile="off", speculative=spec))
        self.name = f"prefill-{uuid.uuid4().hex[:8]}"
        self.loop = PrefillLoop(self.engine, self.name, c.transfer_timeout_s, c.connect_timeout_s,
                                c.handover_transport, FaultPoints(c.fault_points))
        self._reports = 0  # routing stats reported (their report_seq)
        self._view = PrefixView()  # what its prefix cache holds, for cache-aware routing

    async def prefill(self, request: tuple, target: DecodeTarget) -> AsyncIterator[PrefillResult]:
        """A stream: the prompt's PrefillResult (its first token) as soon as it exists, then the end of the
        stream once the KV has left for `target` (at once when the request finished here). `request` is a
        PrefillRequest's wire form: a router of another version gets a ProtocolVersionError before anything
        runs.

        Raises InvalidRequestError for input the engine refuses, and after the first item the hand-over's
        error if it failed. Reading on after the first item is how a caller learns that this replica died
        with the hand-over still queued: the decode side, still waiting for the header, cannot know that
        before its deadline. Cancelling before the first item aborts the prompt; after it, the hand-over
        goes on (the decode side drops what nobody waits for).
        """
        request = PrefillRequest.from_wire(request)
        self._check_layout(target)
        job = self.loop.submit(request, target)
        try:
            result = await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
            self.loop.cancel(request.request_id)
            raise
        yield result
        if job.handed_over is not None:
            try:
                await asyncio.wrap_future(job.handed_over)
            except Exception as e:  # the sender logged the transport's own account (gloo's is long)
                raise ChannelError(f"the KV hand-over to the decode group failed ({type(e).__name__}); "
                                   f"retry") from e

    def _check_layout(self, target: DecodeTarget) -> None:
        mine, theirs = KVLayout.of(self.engine), target.layout
        if mine != theirs:
            differ = [f"{f.name} {getattr(mine, f.name)} vs {getattr(theirs, f.name)}"
                      for f in dataclasses.fields(KVLayout) if getattr(mine, f.name) != getattr(theirs, f.name)]
            raise ValueError(f"prefill KV layout does not match the decode group's: {', '.join(differ)}")

    def model_info(self) -> ModelInfo:
        return ModelInfo(model_dir=self.config.model, max_model_len=self.engine.max_model_len,
                         vocab_size=self.engine.model_cfg.vocab_size,
                         eos_token_ids=tuple(sorted(self.engine.eos_token_ids)))

    def stats(self) -> dict:
        s = self.engine.stats()
        timings = list(self.loop.sender.timings)[-64:]
        return {
            "replica": replica_id(),
            "name": self.name,
            "max_num_batched_tokens": self.config.max_num_batched_tokens,
            "pid": os.getpid(),
            "num_prompts": self.loop.num_jobs,
            "prompt_tokens_waiting": self.loop.prompt_tokens_waiting,
            "handovers_queued": self.loop.sender.queued,
            "handover_failures": self.loop.sender.failures,
            "handovers_dropped": self.loop.sender.dropped,  # unsent: their router had given up on them
            "kv_blocks_used": s["kv_blocks_used"],
            "kv_blocks_total": s["kv_blocks_total"],
            "steps": self.loop.steps,
            "channels": len(self.loop.sender.channels),
            "handovers_total": self.loop.sender.total,
            "finished_at_prefill": self.loop.finished_here,  # never handed over: the first token ended them
            "handovers_by_transport": dict(self.loop.sender.by_transport),
            "grammar": dict(s.get("grammar", {})),
            # query/hit tokens (running totals), cached/evicted blocks; {} with prefix caching off. A prompt's
            # tokens computed here are its query tokens less its hit tokens.
            "prefix_cache": dict(prefix_cache_counts(s)),
            "handovers": [(t.pack_seconds, t.answer_seconds, t.payload_seconds, t.payload_bytes) for t in timings],
        }

    def handover_timings(self, last: int = 512) -> list[tuple[float, float, float, int, bool]]:
        """(pack, answer wait, payload seconds, payload bytes, dropped) of the most recent hand-overs."""
        return [(t.pack_seconds, t.answer_seconds, t.payload_seconds, t.payload_bytes, t.dropped)
                for t in list(self.loop.sender.timings)[-last:]]

    def record_routing_stats(self) -> dict:
        """A PrefillLoad's wire form (cluster/protocol/load.py): Serve polls it and hands it to every router,
        with this replica's prefix view (what its prefix cache holds) for cache-aware routing."""
        s = self.stats()
        self._reports += 1
        pc = self.engine.prefix_cache
        return PrefillLoad(replica=s["replica"], max_num_batched_tokens=s["max_num_batched_tokens"],
                           num_prompts=s["num_prompts"], prompt_tokens_waiting=s["prompt_tokens_waiting"],
                           handovers_queued=s["handovers_queued"], handovers_total=s["handovers_total"],
                           kv_blocks_used=s["kv_blocks_used"], kv_blocks_total=s["kv_blocks_total"],
                           grammar=tuple(s["grammar"].items()),
                           handovers_by_transport=tuple(s["handovers_by_transport"].items()),
                           prefix_cache=tuple(s["prefix_cache"].items()),
                           block_size=0 if pc is None else pc.block_size, prefix_model="" if pc is None else pc.model,
                           cached_blocks=self._view.bits(self.engine), report_seq=self._reports).to_wire()

    def __del__(self):
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()

