"""PrefillServer: the prefill Serve deployment. One engine per replica runs prompts in batches,
samples each one's first token, and hands the KV over to the decode group the router chose."""
from __future__ import annotations

import asyncio
import logging
import os
import uuid

import torch

from cluster.protocol import DecodeTarget, ModelInfo, PrefillRequest, PrefillResult
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
        self.engine = LLMEngine(c.engine_config(detokenize=False))  # the router detokenizes and applies stops
        self.name = f"prefill-{uuid.uuid4().hex[:8]}"
        self.loop = PrefillLoop(self.engine, self.name, c.transfer_timeout_s, c.connect_timeout_s,
                                c.handover_transport)

    async def prefill(self, request: PrefillRequest, target: DecodeTarget) -> PrefillResult:
        """Runs the prompt and returns its first token; the KV then goes to `target` in the background.

        Raises InvalidRequestError for input the engine refuses. Cancelling the call aborts the prompt.
        """
        self._check_layout(target)
        future = self.loop.submit(request, target)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self.loop.cancel(request.request_id)
            raise

    def _check_layout(self, target: DecodeTarget) -> None:
        m, kv = self.engine.model_cfg, self.engine.kv_cache
        lay = target.layout
        mine = (kv.shape[0], m.num_kv_heads, m.head_dim, self.config.block_size,
                str(kv.dtype).removeprefix("torch."))
        theirs = (lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.block_size, lay.dtype)
        if mine != theirs:
            raise ValueError(f"prefill KV layout (layers, kv heads, head dim, block size, dtype) {mine} "
                             f"does not match the decode group's {theirs}")

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
            "kv_blocks_used": s["kv_blocks_used"],
            "kv_blocks_total": s["kv_blocks_total"],
            "steps": self.loop.steps,
            "channels": len(self.loop.sender.channels),
            "handovers_total": self.loop.sender.total,
            "handovers_by_transport": dict(self.loop.sender.by_transport),
            "grammar": dict(s.get("grammar", {})),
            "handovers": [(t.pack_seconds, t.answer_seconds, t.payload_seconds, t.payload_bytes) for t in timings],
        }

    def handover_timings(self, last: int = 512) -> list[tuple[float, float, float, int, bool]]:
        """(pack, answer wait, payload seconds, payload bytes, dropped) of the most recent hand-overs."""
        return [(t.pack_seconds, t.answer_seconds, t.payload_seconds, t.payload_bytes, t.dropped)
                for t in list(self.loop.sender.timings)[-last:]]

    def record_routing_stats(self) -> dict:
        """Small: Serve polls it and broadcasts it to every router."""
        return {k: v for k, v in self.stats().items() if not isinstance(v, list)}

    def __del__(self):
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.stop()

