"""LLM: the offline, batch-at-once API (`from engine import LLM, SamplingParams`)."""
from __future__ import annotations

from typing import Sequence

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.masking.masker import LogitsMasker
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model_dir: str, device: str = "cpu", dtype=None, max_num_seqs: int = 64,
                 num_kv_blocks: int | None = None, block_size: int = 16, speculative=None,
                 logits_masker: LogitsMasker | None = None, **kwargs):
        """`speculative`: an engine.SpecConfig (or a dict of its fields), e.g.
        `SpecConfig(method="eagle3", k=3, draft="path/to/head")`; `logits_masker`: constrains every
        step's tokens (engine/masking/masker.py); other keywords are EngineConfig's."""
        cfg = EngineConfig(model=str(model_dir), device=device, dtype=dtype, max_num_seqs=max_num_seqs,
                           num_kv_blocks=num_kv_blocks, block_size=block_size, speculative=speculative, **kwargs)
        self.engine = LLMEngine(cfg, logits_masker=logits_masker)
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One finished output per prompt, in prompt order. Invalid prompts raise before any runs."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        ids = []
        for prompt, p in zip(prompts, params):
            rid = f"gen-{self._next_id}"
            self._next_id += 1
            try:
                self.engine.add_request(rid, prompt, p)
            except Exception:
                for added in ids:
                    self.engine.abort(added)
                self.engine.step()  # report (and forget) the aborted ones
                raise
            ids.append(rid)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), disable=not use_tqdm, desc="generate")
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.error is not None:  # its grammar did not compile: the caller's error, as before
                    for other in ids:
                        self.engine.abort(other)
                    self.engine.step()
                    raise out.error
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[r] for r in ids]
