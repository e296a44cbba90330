"""Prometheus metrics of the router (GET /metrics): requests, TTFT, inter-token latency, tokens,
queue length, speculative decoding per method, and the KV usage and prefix-cache counters the workers report. One
private registry per router replica."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from router.prefix_affinity import routing_counts

disable_created_metrics()  # the *_created series only add noise to a scrape

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0)


class RouterMetrics:
    def __init__(self, model: str):
        self.registry = r = CollectorRegistry()
        labels = {"model": model}
        self._labels = labels
        self.requests = Counter("tandem_requests", "Finished HTTP requests by endpoint and status code.",
                                ["model", "endpoint", "status"], registry=r)
        self.finish_reasons = Counter("tandem_request_finish_reasons", "Finished outputs by finish reason.",
                                      ["model", "reason"], registry=r)
        self.ttft = Histogram("tandem_time_to_first_token_seconds", "Request arrival to its first token.",
                              ["model"], buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)
        self.itl = Histogram("tandem_inter_token_latency_seconds", "Time between consecutive output tokens.",
                             ["model"], buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)
        self.e2e = Histogram("tandem_request_latency_seconds", "Request arrival to its last token.",
                             ["model"], buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)
        self.prompt_tokens = Counter("tandem_prompt_tokens", "Prompt tokens of admitted requests.",
                                     ["model"], registry=r).labels(**labels)
        self.generation_tokens = Counter("tandem_generation_tokens", "Output tokens sent to clients.",
                                         ["model"], registry=r).labels(**labels)
        self.running = Gauge("tandem_requests_running", "Requests this router is serving now.",
                             ["model"], registry=r).labels(**labels)
        self.queue = Gauge("tandem_queue_length", "Requests admitted but without a first token yet.",
                           ["model"], registry=r).labels(**labels)
        self.structured_violations = Counter(
            "tandem_structured_output_violations", "Guided outputs whose grammar finished but which the schema "
            "rejects (answered with a 500, never as a normal completion): a backend gap to report.",
            ["model"], registry=r).labels(**labels)
        self.rejected = Counter("tandem_requests_rejected", "Requests refused because the queue bound was hit.",
                                ["model"], registry=r).labels(**labels)
        self.kv_used = Gauge("tandem_kv_blocks_used", "KV blocks in use, per worker replica.",
                             ["model", "role", "replica"], registry=r)
        self.kv_total = Gauge("tandem_kv_blocks_total", "KV blocks in total, per worker replica.",
                              ["model", "role", "replica"], registry=r)
        self.kv_usage = Gauge("tandem_kv_cache_usage", "Fraction of KV blocks in use, per worker replica.",
                              ["model", "role", "replica"], registry=r)
        self.worker_queue = Gauge("tandem_worker_queue_length", "Prompts waiting in a prefill replica, or "
                                  "requests waiting in a decode replica.", ["model", "role", "replica"], registry=r)
        self.grammar_events = Gauge("tandem_grammar_events", "Grammar compilations, compiled-grammar cache hits and "
                                    "deserializations (hand-overs) since a worker replica started; a decode "
                                    "replica fed by hand-overs compiles nothing.",
                                    ["model", "role", "replica", "event"], registry=r)
        self.handover_transports = Gauge("tandem_handovers_by_transport", "KV hand-overs a prefill replica sent "
                                         "since it started, by what carried the payload: gloo, nccl or ipc "
                                         "(CUDA IPC / shared memory).", ["model", "replica", "transport"],
                                         registry=r)
        # Speculation per method, summed over the finished requests whose counts the decode side reported
        # (usage.speculative): mean acceptance length = (accepted + verify_steps) / verify_steps.
        spec = ["model", "method"]
        self.spec_drafts = Counter("tandem_spec_decode_draft_tokens", "Draft tokens verified (forced ones included).",
                                   spec, registry=r)
        self.spec_accepted = Counter("tandem_spec_decode_accepted_tokens", "Draft tokens accepted.", spec, registry=r)
        self.spec_forced = Counter("tandem_spec_decode_forced_tokens", "Draft tokens a guided request's grammar "
                                   "forced (among the verified drafts).", spec, registry=r)
        self.spec_steps = Counter("tandem_spec_decode_verify_steps", "Decoding steps that verified drafts (each "
                                  "emits the accepted drafts plus one token).", spec, registry=r)
        self.resumptions = Counter("tandem_request_resumptions", "Requests submitted again as a continuation after "
                                   "a worker died under them, by what failed (decode, prefill, handover).",
                                   ["model", "cause"], registry=r)
        self.resume_pause = Histogram("tandem_resume_pause_seconds", "From a worker failure to the resumed "
                                      "request's next token.", ["model"], buckets=_LATENCY_BUCKETS,
                                      registry=r).labels(**labels)
        self.handover_s = Gauge("tandem_handover_seconds_recent", "Mean KV hand-over payload time of recent "
                                "requests (decode side).", ["model"], registry=r).labels(**labels)
        self.handover_bw = Gauge("tandem_handover_bytes_per_second_recent", "KV hand-over bandwidth of recent "
                                 "requests (decode side).", ["model"], registry=r).labels(**labels)

        self._dp_ranks: dict[str, tuple] = {}  # decode replica -> its per-rank (placed, used, total, running)
        self._transports: dict[str, set[str]] = {}  # prefill replica -> transports it has reported
        self._workers: dict[tuple[str, str], set[str]] = {}  # (role, replica) -> grammar events it reported
        self._prefix_cache: dict[tuple[str, str], dict[str, int]] = {}  # (role, replica) -> its engine's counters
        r.register(_DPRankCollector(self))
        r.register(_PrefixCacheCollector(self))
        r.register(_RoutingCollector(model))

    def dp_ranks(self, replica: str, ranks) -> None:
        """A decode replica's per-rank load (its stats' `dp_ranks`)."""
        if ranks:
            self._dp_ranks[replica] = tuple(tuple(x) for x in ranks)

    def forget_workers(self, role: str, live: set[str]) -> None:
        """Drop the series of `role`'s replicas that are gone (a killed replica's last KV figure would
        otherwise be reported for ever, as a leak that is not there, beside its successor's)."""
        model = self._labels["model"]
        for key in [k for k in self._workers if k[0] == role and k[1] not in live]:
            events = self._workers.pop(key)
            for gauge in (self.kv_used, self.kv_total, self.kv_usage, self.worker_queue):
                gauge.remove(model, role, key[1])
            for event in events:
                self.grammar_events.remove(model, role, key[1], event)
            self._prefix_cache.pop(key, None)
            if role == "decode":
                self._dp_ranks.pop(key[1], None)
            for transport in self._transports.pop(key[1], set()):
                self.handover_transports.remove(model, key[1], transport)

    def grammar(self, role: str, replica: str, counts: dict[str, int]) -> None:
        self._workers.setdefault((role, replica), set()).update(counts)
        for event, n in counts.items():
            self.grammar_events.labels(model=self._labels["model"], role=role, replica=replica, event=event).set(n)

    def prefix_cache(self, role: str, replica: str, counts: dict[str, int]) -> None:
        """A worker's prefix-cache counters (its stats' `prefix_cache`; empty with prefix caching off)."""
        self._workers.setdefault((role, replica), set())
        if counts:
            self._prefix_cache[(role, replica)] = dict(counts)
        else:
            self._prefix_cache.pop((role, replica), None)

    def transports(self, replica: str, counts: dict[str, int]) -> None:
        self._transports.setdefault(replica, set()).update(counts)  # registered by `grammar` as a worker
        for transport, n in counts.items():
            self.handover_transports.labels(model=self._labels["model"], replica=replica, transport=transport).set(n)

    def speculation(self, usage) -> None:
        """One finished request's speculation counts (engine.outputs.SpecUsage)."""
        lab = dict(model=self._labels["model"], method=usage.method)
        self.spec_drafts.labels(**lab).inc(usage.draft_tokens)
        self.spec_accepted.labels(**lab).inc(usage.accepted_tokens)
        self.spec_forced.labels(**lab).inc(usage.forced_tokens)
        self.spec_steps.labels(**lab).inc(usage.verify_steps)

    def resumed(self, cause: str, pause_s: float) -> None:
        """A request whose worker died yields tokens again (router/generation.py Resume.on_resume)."""
        self.resumptions.labels(model=self._labels["model"], cause=cause).inc()
        self.resume_pause.observe(pause_s)

    def request_done(self, endpoint: str, status: int) -> None:
        self.requests.labels(model=self._labels["model"], endpoint=endpoint, status=str(status)).inc()

    def finished(self, reason: str | None) -> None:
        self.finish_reasons.labels(model=self._labels["model"], reason=reason or "unknown").inc()

    def worker(self, role: str, replica: str, used: int, total: int, queue: int) -> None:
        self._workers.setdefault((role, replica), set())
        lab = dict(model=self._labels["model"], role=role, replica=replica)
        self.kv_used.labels(**lab).set(used)
        self.kv_total.labels(**lab).set(total)
        self.kv_usage.labels(**lab).set(used / total if total else 0.0)
        self.worker_queue.labels(**lab).set(queue)

    def handovers(self, seconds: list[float], nbytes: list[int]) -> None:
        if seconds:
            self.handover_s.set(sum(seconds) / len(seconds))
            self.handover_bw.set(sum(nbytes) / max(sum(seconds), 1e-9))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _DPRankCollector:
    """Per-rank series of decode groups, from the counts their replicas report: a counter must be
    exported as the worker's own running total, not re-counted by each router."""

    def __init__(self, metrics: RouterMetrics):
        self.metrics = metrics

    def collect(self):
        model = self.metrics._labels["model"]
        labels = ["model", "replica", "dp_rank"]
        placed = CounterMetricFamily("tandem_decode_dp_rank_requests", "Requests the decode controller placed on "
                                     "each rank of its group (under attention data parallelism one rank holds a "
                                     "request; under TP every rank does).", labels=labels)
        used = GaugeMetricFamily("tandem_decode_dp_rank_kv_blocks_used", "KV blocks in use on each decode rank.",
                                 labels=labels)
        running = GaugeMetricFamily("tandem_decode_dp_rank_requests_running", "Requests running on each decode rank.",
                                    labels=labels)
        for replica, ranks in self.metrics._dp_ranks.items():
            for i, (n_placed, n_used, _total, n_running) in enumerate(ranks):
                key = [model, replica, str(i)]
                placed.add_metric(key, n_placed)
                used.add_metric(key, n_used)
                running.add_metric(key, n_running)
        yield placed
        yield used
        yield running


class _PrefixCacheCollector:
    """Per worker replica: prompt tokens looked up in its engine's prefix cache and tokens reused (counters,
    the worker's own running totals), cached blocks (a gauge: free blocks a next prompt may reuse) and blocks
    evicted. A decode group reports rank 0's engine (under attention data parallelism, the sum of its ranks);
    its hits are requests recomputed after a preemption: the blocks a hand-over reuses from the decode cache are
    counted apart (tandem_handover_blocks_reused_total)."""

    def __init__(self, metrics: RouterMetrics):
        self.metrics = metrics

    def collect(self):
        model = self.metrics._labels["model"]
        labels = ["model", "role", "replica"]
        queries = CounterMetricFamily("tandem_prefix_cache_queries_tokens", "Prompt tokens looked up in the "
                                      "prefix cache at admission, per worker replica.", labels=labels)
        hits = CounterMetricFamily("tandem_prefix_cache_hits_tokens", "Prompt tokens whose KV the prefix cache "
                                   "supplied (not computed), per worker replica.", labels=labels)
        evicted = CounterMetricFamily("tandem_prefix_cache_evicted_blocks", "Cached blocks reused for new KV, "
                                      "per worker replica.", labels=labels)
        cached = GaugeMetricFamily("tandem_prefix_cache_cached_blocks", "KV blocks findable in the prefix cache, "
                                   "per worker replica (free ones among them count as free KV).", labels=labels)
        reused = CounterMetricFamily("tandem_handover_blocks_reused", "Prompt KV blocks a decode replica's ranks "
                                     "held already, so that its hand-overs did not carry them.", labels=labels)
        local = CounterMetricFamily("tandem_local_prefills", "Requests a decode replica's group prefilled itself "
                                    "(it held all but a short remainder of the prompt: no prefill replica, no "
                                    "hand-over).", labels=labels)
        local_tokens = CounterMetricFamily("tandem_local_prefill_tokens", "The uncached prompt tokens of those "
                                           "requests, as the decode replica estimated them.", labels=labels)
        for (role, replica), c in self.metrics._prefix_cache.items():
            key = [model, role, replica]
            queries.add_metric(key, c.get("query_tokens", 0))
            hits.add_metric(key, c.get("hit_tokens", 0))
            evicted.add_metric(key, c.get("evicted_blocks", 0))
            cached.add_metric(key, c.get("cached_blocks", 0))
            if "handover_reused_blocks" in c:
                reused.add_metric(key, c["handover_reused_blocks"])
            if "local_prefills" in c:
                local.add_metric(key, c["local_prefills"])
                local_tokens.add_metric(key, c.get("local_prefill_tokens", 0))
        yield queries
        yield hits
        yield evicted
        yield cached
        yield reused
        yield local
        yield local_tokens


class _RoutingCollector:
    """How this router chose prefill replicas (router/prefix_affinity.py): by prefix overlap, by load, or by
    load because the balance guard overrode the overlap; when its prefix view could not be trusted and it
    routed by load alone, why; and the prompt tokens it expected its choices to hold cached."""

    def __init__(self, model: str):
        self.model = model

    def collect(self):
        decisions = CounterMetricFamily("tandem_routing_decisions", "Prompts routed to a prefill or decode "
                                        "replica, by what decided: prefix (overlap and load), load (no replica "
                                        "held any of the prompt, or the least loaded did) or balance (the "
                                        "load-imbalance guard overrode the overlap).",
                                        labels=["model", "role", "outcome"])
        fallbacks = CounterMetricFamily("tandem_routing_fallback", "Prompts routed by load alone because the "
                                        "prefix view was not trusted: no_report, unreadable, stale or "
                                        "replica_gone.", labels=["model", "role", "reason"])
        expected = CounterMetricFamily("tandem_routing_expected_hit_tokens", "Prompt tokens the router expected "
                                       "the chosen prefill replica to hold cached.", labels=["model", "role"])
        counts = routing_counts()
        for outcome in ("prefix", "load", "balance"):
            decisions.add_metric([self.model, "prefill", outcome], counts.get(("decision", outcome), 0))
            decisions.add_metric([self.model, "decode", outcome], counts.get(("decode_decision", outcome), 0))
        for reason in ("no_report", "unreadable", "stale", "replica_gone"):
            fallbacks.add_metric([self.model, "prefill", reason], counts.get(("fallback", reason), 0))
        expected.add_metric([self.model, "prefill"], counts.get(("expected_hit_tokens", ""), 0))
        yield decisions
        yield fallbacks
        yield expected
