"""LLMEngine: the step-level API the workers drive (add_request, step, abort) plus the hand-over
hooks of disaggregated serving (prefill-only requests that park, and reserve/commit on the decode side).

One step is schedule -> build the batch -> run -> update, the same with and without speculation (no
speculation is k = 0 of the speculative step). Bad input raises InvalidRequestError from add_request
and never reaches the running batch, so other requests are unaffected. With speculation
(EngineConfig.speculative) a step verifies each decoding request's drafts and emits up to k+1 tokens
per request.
"""
from __future__ import annotations

import time

import torch

from engine.config import EngineConfig, ModelConfig
from engine.core.block_manager import BlockManager
from engine.core.prefix_cache import PrefixCache
from engine.core.request import Continuation, Request, RequestStatus
from engine.core.scheduler import Scheduler, ScheduledRequest
from engine.distributed.data_parallel import DPContext
from engine.distributed.parallel import TPContext
from engine.errors import InvalidRequestError
from engine.handover import Handover, HandoverDrafts, HandoverRequest
from engine.handovers import Handovers
from engine.intake import RequestIntake
from engine.masking.guided import GuidedRequests
from engine.masking.masker import LogitsMasker
from engine.outputs import RequestOutput, TokenLogprob
from engine.prompt_logprobs import prompt_logprobs
from engine.runner.model_runner import ModelRunner, StepResult
from engine.runner.overlap import InFlight, carry_blocker
from engine.runner.target import load_target
from engine.sampling_params import SamplingParams
from engine.speculative.drafter import Drafter
from engine.speculative.stats import SpecStats
from structured.request import SerializedGrammar


class LLMEngine:
    def __init__(self, cfg: EngineConfig, tp_group=None, logits_masker: LogitsMasker | None = None,
                 cpu_group=None, tp_shm=None):
        """tp_group: the torch.distributed group of the tp_size ranks; cpu_group: a gloo group of the same
        ranks for the attention-data-parallel lockstep agreement (default tp_group, right for CPU engines);
        tp_shm: shared-memory collectives of the same ranks (engine/distributed/shm_collectives.py: CPU ranks of one
        host), which carry the tensor-parallel all-reduces and gathers that fit them (under attention data
        parallelism: the MLP row exchanges and the step agreement);
        logits_masker: constrains the tokens of every step (engine/masking/masker.py).

        With cfg.attention_dp > 1 every rank of the group must call step() the same number of times,
        with or without requests of its own: each step starts with the group's agreement."""
        self.cfg = cfg
        self.model_cfg = ModelConfig.from_dir(cfg.model)
        self.dp: DPContext | None = None
        if cfg.attention_dp > 1:
            self.dp = DPContext(cfg.tp_rank, cfg.tp_size, tp_group, cpu_group, cfg.adp_exchange, tp_shm,
                                cfg.expert_parallel)
            self.tp = TPContext()  # attention, embeddings and the draft network are replicated on every rank
        else:
            self.tp = TPContext(cfg.tp_rank, cfg.tp_size, tp_group, tp_shm, cfg.expert_parallel)
        limit = self.model_cfg.max_position_embeddings
        if self.model_cfg.sliding_window:
            limit = min(limit, self.model_cfg.sliding_window)  # no sliding-window attention yet: stay inside it
        max_model_len = min(cfg.max_model_len or limit, limit)
        target = load_target(cfg, self.model_cfg, self.tp, max_model_len, self.dp)
        self.drafter = Drafter(cfg.speculative, target)  # the engine's; k = 0 without speculation
        self.runner = ModelRunner(cfg, target, self.drafter, max_model_len, self.dp)
        num_blocks = cfg.num_kv_blocks or self.runner.auto_num_blocks(max_model_len)
        self.kv_cache = self.runner.allocate_kv_cache(num_blocks)
        adaptive = self.drafter.adaptive
        # Adaptive k's cost table starts from this machine's step times. Tensor-parallel ranks run the probe's steps
        # together (their collectives meet) and all take rank 0's times, so that they price k alike. Not under
        # attention data parallelism yet: its eager steps' collectives need the group's agreed rows.
        if adaptive is not None and self.dp is None and cfg.speculative.cost_probe:
            from engine.runner.cost_probe import probe_step_costs, rank0s

            adaptive.cost.set_probe(rank0s(probe_step_costs(self.runner, cfg.max_num_seqs), self.tp,
                                         self.runner.device))
        self.blocks = BlockManager(num_blocks, cfg.block_size)
        # A request alone must always fit, or preemption could not make progress.
        self.max_model_len = min(max_model_len, num_blocks * cfg.block_size)
        # A draft head with KV (MTP, EAGLE-3, a draft model) writes a position's KV once the next token is known:
        # its blocks are final for the prefix cache one token after the target's
        draft_lag = 1 if getattr(self.drafter.proposer, "num_cache_layers", 0) else 0
        self.prefix_cache = PrefixCache(self.blocks, cfg.model, draft_lag) if cfg.enable_prefix_caching else None
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.enable_chunked_prefill,
                                   num_lookahead_slots=self.drafter.lookahead_slots, prefix_cache=self.prefix_cache)
        self.spec_stats = SpecStats(cfg.speculative)
        self.requests: dict[str, Request] = {}
        self.intake = RequestIntake(cfg.model, self.model_cfg.vocab_size, self.model_cfg.eos_token_ids,
                                    self.max_model_len, cfg.detokenize, cfg.seed, self.requests)
        self.tokenizer, self.eos_token_ids = self.intake.tokenizer, self.intake.eos_token_ids
        # the engine's masker (logits_masker, or its grammars'), handed to each step it masks
        self.guided = GuidedRequests(self.tokenizer, self.model_cfg.vocab_size, self.eos_token_ids, logits_masker,
                                     cfg.speculative is not None and cfg.speculative.forced_drafts)
        if self.tp.size > 1:  # every rank installs a grammar in the same step (GuidedRequests.agree)
            self.guided.agree = self._agree_compiled
        self.handovers = Handovers(self.requests, self.blocks, self.scheduler, self.drafter, self.guided,
                                   self.intake.new, cfg.block_size, self.runner.num_cache_layers,
                                   self.runner.kv_spec)
        self._finished_unreported: list[Request] = []
        self._inflight: InFlight | None = None  # async scheduling: the launched step not read yet
        self.num_overlapped_steps = 0  # steps launched before the previous step's outputs were read

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    prefill_only: bool = False, continuation: Continuation | None = None,
                    seed: int | None = None) -> None:
        """Queue a request. A guided request's grammar starts compiling here and its prompt runs meanwhile;
        only the step that samples its first token waits for the grammar (the scheduler holds that
        chunk back). InvalidRequestError at once for a bad request or a refused schema; a grammar that
        fails to compile finishes the request with finish_reason "error" and the error in its output.
        continuation: the request resumes after output it produced on another engine (Continuation); its
        outputs then report only the tokens that follow. seed: the one it samples with when `params` give none
        (another process chose it, for a resumption; default: drawn here); `params.seed` still decides whether
        speculation verifies it as a seeded request."""
        req = self.intake.new(request_id, prompt, params or SamplingParams(), prefill_only, seed=seed,
                              continuation=continuation)
        if req.params.prompt_logprobs is not None and self.dp is not None:
            # its own forward would run outside the group's lockstep (engine/prompt_logprobs.py)
            raise InvalidRequestError("prompt logprobs are not computed under attention data parallelism",
                                      param="prompt_logprobs")
        if req.params.structured_output is not None:
            self.guided.start(request_id, req.params.structured_output)
            req.grammar_ready = False
        self.requests[request_id] = req
        self.scheduler.add(req)

    def warm_grammar(self, structured, compiled: SerializedGrammar | None) -> None:
        """Load a hand-over's compiled grammar into the compiler's cache now, on the caller's thread
        (GuidedRequests.warm): `reserve` on the step thread then finds it there."""
        self.guided.warm(structured, compiled)

    def _agree_compiled(self, done: list[bool]) -> list[bool]:
        """TP ranks: which compiles in flight are done on every rank (a small all-reduce, only while any is)."""
        x = torch.tensor(done, dtype=torch.float32, device=self.runner.device)
        return (self.tp.all_reduce(x) == self.tp.size).tolist()

    def _install_grammars(self, wait: bool) -> None:
        """Matchers for the requests whose grammar finished compiling; a failed compile finishes its request
        with the error (blocks freed)."""
        for req in self.guided.install(self.requests, wait):
            self._finish(req, RequestStatus.FINISHED_ERROR)
            self._finished_unreported.append(req)

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None or req.status.finished:
            return
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        self._finished_unreported.append(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._finished_unreported) or self._inflight is not None

    @property
    def in_flight(self) -> tuple[str, ...]:
        """Async scheduling: the requests of the step launched and not read yet (empty: none is)."""
        return tuple(s.request.request_id for s in self._inflight.scheduled) if self._inflight is not None else ()

    def stats(self) -> dict:
        out = {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_parked": sum(r.status in (RequestStatus.PARKED, RequestStatus.RESERVED) for r in self.requests.values()),
            "kv_blocks_used": self.blocks.pool.num_used,
            "prefix_cache": self._prefix_cache_stats(),
            "kv_blocks_total": self.blocks.pool.num_blocks,
            "overlapped_steps": self.num_overlapped_steps,
        }
        out.update(self.spec_stats.as_dict())
        out.update(self.guided.stats())
        return out

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """One step: schedule -> launch -> collect -> update, alike with and without speculation. With
        async scheduling the step launched here stays in flight and the call returns the outputs of the
        step launched by the previous call, read while this one runs (engine/runner/overlap.py)."""
        prev, started = self._inflight, time.perf_counter()
        if prev is None:
            self._admit_pending()
        nxt = self._launch(prev)
        self._inflight = nxt if nxt is not None and nxt.overlap else None
        touched: list[Request] = []
        for done in (prev, None if self._inflight is not None else nxt):
            if done is not None:
                res = self.runner.collect(done.prepared, done.launched)
                touched += self._update(done.scheduled, res, self._inflight) if res is not None else []
        if self._inflight is not None and all(s.request.status.finished for s in self._inflight.scheduled):
            self._inflight = None  # it only ran rows of requests that just ended: nothing in it to read
        if nxt is not None and self._inflight is None:  # adaptive k's cost fit: the time of a step read at once
            self.drafter.timed(nxt.scheduled, time.perf_counter() - started)
        reports = self._finished_unreported + touched
        self._finished_unreported = []
        return [self._output(r) for r in reports]

    def _admit_pending(self) -> None:
        """Before a step planned on the host's state: matchers for the grammars that finished compiling."""
        if self.guided.compiling:
            self._install_grammars(wait=False)

    def _launch(self, prev: InFlight | None) -> InFlight | None:
        """Schedule, build and launch the next step (None: none runs now). With `prev` in flight the step is
        planned ahead of its outputs, only where nothing in it waits on them on the host; else the
        step may stay in flight (overlap) when nothing in the step after it will."""
        if prev is not None and not self._can_plan_ahead():
            return None  # prev is read first; the next call steps synchronously
        self._limit_drafts()
        sched = self.scheduler.schedule(prev.rows() if prev is not None else None, self._drafts_ahead)
        if sched is not None and sched.empty and self.guided.compiling and not self._finished_unreported:
            self._install_grammars(wait=True)  # only compiles are left to wait for: no busy loop
            sched = self.scheduler.schedule()
        if sched is None:
            return None
        for req in sched.preempted:
            self.drafter.release(req.request_id)
        if sched.empty and self.dp is None:  # an ADP rank joins the group's step regardless
            return None
        assert all(s.request.grammar_ready for s in sched.scheduled if s.sample), "sampled before its grammar"
        step = self.runner.prepare(sched.scheduled, self.blocks, self.guided.masker, carry_from=prev)
        if step is None:
            return None
        self.num_overlapped_steps += prev is not None
        overlap = prev is not None or (step.masker is None and step.batch is not None and self._can_plan_ahead())
        return InFlight(sched.scheduled, step, self.runner.launch(step), overlap)

    # ------------------------------------------------------------------ async scheduling (engine/runner/overlap.py)
    def _can_plan_ahead(self) -> bool:
        """Can a step be planned before the running one is read: the option is on and no request waits on
        the host for the running step's tokens (carry_blocker)."""
        if (not self.cfg.async_scheduling or self.dp is not None or self.guided.compiling
                or self.drafter.adaptive is not None):  # adaptive k decides each step from the last one's outcome
            return False
        return all(carry_blocker(r, self.drafter.drafts_on_host) is None
                   for r in (*self.scheduler.running, *self.scheduler.waiting))

    def _drafts_ahead(self, req: Request, emitted: int) -> int:
        """Drafts a carried request verifies next step, with room counted as if the running step emits
        `emitted` tokens for it (all its drafts accepted): the rule a synchronous step drafts by too
        (Drafter.next_drafts), so both verify the same drafts. If the running step does end the request,
        the row planned for it is dropped."""
        emitted = self.drafter.most_accepted(emitted - 1) + 1  # a tree's step emits one path, not its N nodes
        return max(0, min(self.drafter.k_for(len(self.scheduler.running)), self.drafter.room(req, emitted)))

    def _update(self, scheduled: list[ScheduledRequest], res: StepResult, ahead: InFlight | None = None) -> list[Request]:
        """Emit each request's accepted drafts and bonus token (one token without speculation), stopping
        at the first that ends it; rewind the KV of rejected drafts (and of the draft chain's lookahead)
        by lengths alone, keeping what `ahead` (the step launched after this one) uses."""
        next_rows = {s.request.request_id: s.num_new_tokens for s in ahead.scheduled} if ahead is not None else {}
        now = time.monotonic()
        touched = []
        for b, s in enumerate(scheduled):
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            emitted = res.tokens[b]
            if not emitted or req.status is not RequestStatus.RUNNING:
                continue
            if req.params.prompt_logprobs is not None and not req.num_output_tokens:  # its first token: KV in place
                req.prompt_logprobs = prompt_logprobs(
                    self.runner.model, self.kv_cache, self.blocks.table(req.request_id), self.cfg.block_size,
                    req.prompt_token_ids, req.params.prompt_logprobs, self.cfg.max_num_batched_tokens)
            num_drafts, accepted = res.num_drafts[b], len(emitted) - 1
            req.num_computed_tokens -= num_drafts - accepted
            if req.num_output_tokens and s.num_new_tokens == num_drafts + 1:  # decoding, not a prompt's end
                forced = req.spec_forced & (1 << num_drafts) - 1
                # a tree's accepted path may run past max_tokens (its nodes are not cut by it: Drafter.room); usage
                # counts the tokens it emits
                counted = min(accepted, req.params.max_tokens - req.num_output_tokens - 1)
                self.spec_stats.count(req, num_drafts, counted, forced.bit_count())
                self.drafter.observe(req, num_drafts, accepted, forced)
            req.spec_token_ids, req.spec_forced = [], 0
            n = 0
            while n < len(emitted) and req.status is RequestStatus.RUNNING:
                if req.params.logprobs is not None:
                    top = None
                    if req.params.logprobs > 0:
                        top = dict(zip(res.top_ids[b][n][: req.params.logprobs],
                                       res.top_logprobs[b][n][: req.params.logprobs]))
                    req.logprobs.append(TokenLogprob(emitted[n], res.logprobs[b][n], top))
                self._append_token(req, emitted[n], now)
                n += 1
            touched.append(req)
            if req.status.finished:
                continue
            held = self.blocks.num_slots.get(req.request_id, 0)
            keep = req.num_computed_tokens
            if req.request_id in next_rows:  # its next step runs from here, with its lookahead
                keep = min(held, self.scheduler.slots_needed(req, next_rows[req.request_id]))
            self.blocks.rewind(req.request_id, held - keep)
            step_drafts, lead = res.drafts[b] if res.drafts else None, self.guided.forced_drafts(req)
            forced_steps = self.guided.forced_steps(req) if res.draft_forced is None else res.draft_forced[b]
            if req.status is RequestStatus.PARKED:  # its first drafts go with it, forced ones marked (usage)
                req.handover_drafts = self.drafter.parked(req, step_drafts, lead, forced_steps)
                self.drafter.release(req.request_id)
            else:
                rejected = self.drafter.most_accepted(num_drafts) - accepted
                req.spec_token_ids = self.drafter.next_drafts(req, step_drafts, rejected, lead,
                                                              forced_steps)
        if self.prefix_cache is not None:
            for s in scheduled:
                if not s.request.status.finished:
                    self.prefix_cache.progress(s.request)
        return touched

    def _limit_drafts(self) -> None:
        """Dynamic and adaptive k: verify at most this step's k drafts per request (Drafter.step_k). Under attention
        data parallelism the batch (and adaptive k's vote) is the group's at the last agreement, the same on every
        rank, so every rank verifies the same k. Dynamic k alone still runs the whole draft chain; adaptive k runs
        k passes of it (graph steps replay the graph of k passes, except under ADP, where they run all)."""
        if not self.drafter.dynamic_k:
            return
        plan = self.runner.last_plan
        batch = plan.total_requests if plan is not None else len(self.scheduler.running)
        if not batch:
            return
        k = self.drafter.step_k(batch, self.scheduler.running, plan.vote if plan is not None else None, self.dp is not None)
        self.spec_stats.dynamic_k_steps[k] += 1
        for req in self.scheduler.running:
            if len(req.spec_token_ids) > k:
                req.spec_token_ids = req.spec_token_ids[:k]

    def _append_token(self, req: Request, token: int, now: float) -> None:
        req.token_ids.append(token)
        m = req.metrics
        m.num_output_tokens = req.num_output_tokens
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        self.guided.accept(req.request_id, token)
        stop_string = req.detokenizer.push((token,)).stop if req.detokenizer is not None else None
        status = self._stop_status(req, token, stop_string)
        if status is not None:
            if req.stop_reason is None and req.detokenizer is not None:
                req.detokenizer.flush()  # a held-back partial character
            self._finish(req, status)
        elif req.prefill_only:
            self.scheduler.remove(req)
            req.status = RequestStatus.PARKED

    def _stop_status(self, req: Request, token: int, stop_string: str | None) -> RequestStatus | None:
        p = req.params
        if token in p.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if not p.ignore_eos and token in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if self.guided.terminated(req.request_id):
            return RequestStatus.FINISHED_STOPPED  # the grammar is complete
        if stop_string is not None:
            req.stop_reason = stop_string
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= req.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _prefix_cache_stats(self) -> dict | None:
        if self.prefix_cache is None:
            return None
        st = self.prefix_cache.stats
        return {"query_tokens": st.queries, "hit_tokens": st.hits, "hit_rate": st.hit_rate,
                "cached_blocks": self.blocks.pool.num_cached, "evicted_blocks": self.blocks.pool.num_evicted,
                "deferred_admissions": st.deferred}

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self.scheduler.remove(req)
        if self.prefix_cache is not None and status is not RequestStatus.FINISHED_ERROR:
            self.prefix_cache.progress(req)  # its answer's blocks too: a next turn starts with them
        if self.prefix_cache is not None:
            self.prefix_cache.forget(req)
        self.blocks.free(req.request_id)
        self.drafter.release(req.request_id)
        self.guided.release(req.request_id)
        req.spec_token_ids = []
        req.status = status
        req.finish_reason = status.value
        req.metrics.finished_time = time.monotonic()

    def _output(self, req: Request) -> RequestOutput:
        new = req.token_ids[req.num_prompt_tokens + req.num_reported:]
        req.num_reported = req.num_output_tokens
        finished = req.status.finished
        if finished:
            self.requests.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, token_ids=req.output_token_ids,
            new_token_ids=new, text=req.detokenizer.visible_text(finished) if req.detokenizer is not None else "",
            finished=finished, finish_reason=req.finish_reason,
            stop_reason=req.stop_reason, logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
            metrics=req.metrics, error=req.error, prompt_logprobs=req.prompt_logprobs,
            speculative=self.spec_stats.usage(req))

    # ------------------------------------------------------------------ disaggregation hooks (engine/handovers.py)
    def take_handover(self, request_id: str) -> Handover:
        """A parked (prefilled) request's description and blocks; they stay held until release()."""
        return self.handovers.take(request_id)

    def release(self, request_id: str) -> None:
        self.handovers.release(request_id)

    def reserve(self, handover: HandoverRequest, compiled_grammar: SerializedGrammar | None = None,
                block_ids: list[int] | None = None) -> list[int]:
        """Decode side: blocks for an incoming request's KV (Handovers.reserve); CapacityError if full."""
        return self.handovers.reserve(handover, compiled_grammar, block_ids)

    def commit(self, request_id: str, drafts: HandoverDrafts | None = None) -> None:
        """Decode side: the received KV is in place; the request joins the running batch, verifying `drafts`
        (Handover.drafts) in its first step."""
        self.handovers.commit(request_id, drafts)

