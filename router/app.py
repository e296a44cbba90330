"""The Serve ingress: OpenAI-compatible HTTP API on FastAPI.

POST /v1/completions, /v1/chat/completions and /v1/responses (streaming and not), GET /v1/models and
/v1/models/{model}, /health, /metrics.
The router validates, templates and tokenizes; Generation carries the request through the workers;
the router detokenizes, applies stop strings and writes the response.
"""

import asyncio
import time
import uuid

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve

from engine.errors import TandemError
from engine.sampling_params import SamplingParams
from router.access import AccessGate, install_limits
from router.config import RouterConfig
from router.errors import APIError, install, invalid
from router.decode_feed import DecodeFeeds
from router.generation import Generation, Resume
from router.ingress import ApiServer, unless_client_leaves
from router.limits import check_request, check_unicode
from router.choices import Choices, child_seed, start_all
from router.output import ResponseWriter
from router.sink import OutputText, ResponseSink
from router.metrics import RouterMetrics
from router.metrics_server import start_metrics_server
from router.policy import decode_unavailable, latest_stats, load_of
from router.protocol import ChatCompletionRequest, CompletionRequest
from router.responses_api import ResponseEvents, ResponseShape, ResponsesRequest, to_chat
from router.token_text import TokenText
from router.tools import chat_messages, template_tools

HEALTH_PROBE_S = 2.0  # /health stays fast even when the decode replica is slow to answer

api = FastAPI(title="Tandem", description="Disaggregated structured, speculative LLM serving (OpenAI API)")
install(api)
api.add_middleware(AccessGate)


@serve.ingress(api)
class Router:
    async def __init__(self, prefill, decode, config: RouterConfig | dict):
        from transformers import AutoTokenizer

        self.cfg = config if isinstance(config, RouterConfig) else RouterConfig(**config)
        install_limits(api, self.cfg)
        self.prefill, self.decode = prefill, decode
        self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.model)
        self.token_text = TokenText(self.tokenizer)  # logprobs' token text and bytes
        self.info = await prefill.model_info.remote()
        self.metrics = RouterMetrics(self.cfg.served_model_name)
        # what response writers get instead of the router (router/sink.py)
        self.output = OutputText(self.cfg.served_model_name, self.tokenizer, self.token_text)
        self.sink = ResponseSink(self.metrics, self._choice_ended)
        self.inflight = 0
        self.actor_name = ray.get_runtime_context().get_actor_name()  # None outside an actor (tests)
        self.feeds = DecodeFeeds(decode, self.actor_name, self.cfg.feed_link)  # decode deltas, one feed per replica
        self.resume = Resume(self.cfg.resume_attempts, self.cfg.resume_deadline_s, self.metrics.resumed)
        self.waiting_first = 0
        self.created = int(time.time())
        self.metrics_server = None
        if self.cfg.metrics_port is not None:
            self.metrics_server = await start_metrics_server(self.cfg.metrics_host, self.cfg.metrics_port,
                                                             self._render_metrics)
        # Direct ingress (router/ingress.py): this replica answers HTTP on the API address itself.
        self.api_server = (ApiServer(api, self.cfg.api_host, self.cfg.api_port, self.cfg.shutdown_grace_s)
                           if self.cfg.api_port else None)

    async def check_health(self) -> None:
        """Serve's periodic probe: a replica whose own API server stopped is replaced."""
        failed = self.api_server.failed if self.api_server is not None else None
        if failed is not None:
            raise RuntimeError(failed)

    async def __del__(self):
        # Serve awaits this when it stops the replica: open streams get a moment to end, and the port is let
        # go. It must be a coroutine function: Serve's ingress wrapper awaits the class's __del__ only then,
        # and dropped the coroutine a sync one returned (the stop never ran; streams were cut when the process
        # went, with a "never awaited" warning).
        server, self.api_server = getattr(self, "api_server", None), None
        if server is not None:
            await server.stop()

    # ------------------------------------------------------------------ plain endpoints
    @api.get("/health")
    async def health(self):
        # 503 while no decode group can take a request, so that a load balancer stops sending traffic here.
        # Asked fresh (routing stats are refreshed only by requests); the load-aware pick prefers a replica
        # whose group is up, so "down" means every replica's is. No answer in time: no verdict.
        try:
            fresh = await asyncio.wait_for(self.decode.record_routing_stats.remote(), HEALTH_PROBE_S)
        except Exception:  # noqa: BLE001 - the request path reports its own errors
            fresh = {}
        reason = decode_unavailable({"probe": load_of("decode", fresh)})
        if reason is not None:
            return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [self._model_card()]}

    @api.get("/v1/models/{model:path}")
    async def model(self, model: str) -> dict:
        self._check_model(model)
        return self._model_card()

    def _model_card(self) -> dict:
        return {"id": self.cfg.served_model_name, "object": "model", "created": self.created, "owned_by": "tandem",
                "max_model_len": self.info.max_model_len}

    def _check_model(self, model: str) -> None:
        """A model this server does not serve is a 404 `model_not_found`, as OpenAI and vLLM answer it."""
        if model != self.cfg.served_model_name:
            raise APIError(404, f"the model {model!r} does not exist here; available: "
                                f"[{self.cfg.served_model_name!r}]", "invalid_request_error", "model",
                           "model_not_found")

    @api.get("/metrics")
    async def metrics(self) -> PlainTextResponse:
        if self.metrics_server is not None:
            raise APIError(404, "this server serves /metrics on its metrics port, not on the API port",
                           "not_found_error", None, "metrics_elsewhere")
        return PlainTextResponse((await self._render_metrics()).decode(), media_type="text/plain; version=0.0.4")

    async def _render_metrics(self) -> bytes:
        await self._refresh_worker_gauges()
        return self.metrics.render()

    async def _refresh_worker_gauges(self) -> None:
        fresh = await asyncio.gather(self.prefill.stats.remote(), self.decode.stats.remote(), return_exceptions=True)
        for role, direct in zip(("prefill", "decode"), fresh):
            by_replica = latest_stats(role)
            if isinstance(direct, dict):
                by_replica[direct.get("replica", role)] = direct
                if role == "decode":
                    self.metrics.handovers(direct.get("handover_seconds", []), direct.get("handover_bytes", []))
            for replica, s in by_replica.items():
                if not s:
                    continue
                queue = s.get("num_prompts", 0) if role == "prefill" else s.get("num_requests", 0) - s.get("num_running", 0)
                self.metrics.worker(role, replica, s.get("kv_blocks_used", 0), s.get("kv_blocks_total", 0), queue)
                self.metrics.grammar(role, replica, s.get("grammar") or {})
                self.metrics.prefix_cache(role, replica, s.get("prefix_cache") or {})
                if role == "decode":
                    self.metrics.dp_ranks(replica, s.get("dp_ranks"))
                else:
                    self.metrics.transports(replica, s.get("handovers_by_transport") or {})
            self.metrics.forget_workers(role, set(by_replica))

    def routing_snapshot(self) -> dict:
        """The load each worker replica last reported to this router's routing policy (handle call)."""
        return {role: latest_stats(role) for role in ("prefill", "decode")}

    # ------------------------------------------------------------------ generation endpoints
    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        self._check_model(body.model)
        check_request(body, self.cfg, self.info.vocab_size, chat=False)
        prompt = body.prompt
        # A list of strings or of token lists is a batch: one choice per prompt (times n), indexed in order.
        batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
        if body.suffix:
            raise invalid("suffix is not supported", "suffix")
        if body.logprobs is not None and not 0 <= body.logprobs <= self.cfg.max_logprobs:
            raise invalid(f"logprobs must be between 0 and {self.cfg.max_logprobs}, got {body.logprobs}", "logprobs")
        prompts = [self._completion_prompt(p, body.echo) for p in batch]
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        return await self._generate(body, request, prompts, max_tokens, body.logprobs, chat=False)

    def _completion_prompt(self, prompt: str | list[int], echo: bool) -> tuple[list[int], str]:
        """One prompt of a completions request: (its token ids, the text echo prepends or "")."""
        if isinstance(prompt, str):
            check_unicode(prompt, "prompt")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt_ids = list(prompt)
            bad = [t for t in prompt_ids if not 0 <= t < self.info.vocab_size]
            if bad:
                raise invalid(f"token id(s) {bad[:5]} outside the vocabulary [0, {self.info.vocab_size})", "prompt")
        return prompt_ids, (prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt_ids)) if echo else ""

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        return await self._chat(body, request)

    @api.post("/v1/responses")
    async def responses(self, body: ResponsesRequest, request: Request):
        """The Responses API, stateless: the chat path, its answer reshaped (router/responses_api.py)."""
        self._check_model(body.model)
        shape = ResponseShape(body, self.cfg.served_model_name)
        return await self._chat(to_chat(body), request, whole_as=shape.whole,
                                 stream_as=lambda chat_sse: ResponseEvents(shape).sse(chat_sse))

    async def _chat(self, body: ChatCompletionRequest, request: Request, whole_as=None, stream_as=None):
        self._check_model(body.model)
        check_request(body, self.cfg, self.info.vocab_size, chat=True)
        tools = body.tool_request()
        knows_tools = self._template_knows_tools()
        messages = chat_messages(body.messages, tools, knows_tools, self._template_mentions("developer"))
        extra = {"tools": template_tools(tools)} if knows_tools and tools is not None else {}
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=body.add_generation_prompt,
                                                      **extra, **(body.chat_template_kwargs or {}))
        except Exception as e:  # noqa: BLE001 - template errors are the request's fault (roles, order)
            raise invalid(f"the chat template cannot render these messages: {e}", "messages") from e
        prompt_ids = self.tokenizer.encode(text, add_special_tokens=False)
        top_limit = self.cfg.max_logprobs
        if body.top_logprobs is not None and not (body.logprobs and 0 <= body.top_logprobs <= top_limit):
            raise invalid(f"top_logprobs needs logprobs=true and must be between 0 and {self.cfg.max_logprobs}, "
                          f"got {body.top_logprobs}", "top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        max_tokens = next((m for m in (body.max_completion_tokens, body.max_tokens) if m is not None),
                          max(1, self.info.max_model_len - len(prompt_ids)))
        return await self._generate(body, request, [(prompt_ids, "")], max_tokens, logprobs, chat=True,
                                    tools=tools if tools is not None and tools.constrains else None,
                                    whole_as=whole_as, stream_as=stream_as)

    def _template_knows_tools(self) -> bool:
        """Whether the chat template renders `tools` itself (transformers passes them as a variable);
        if not, router/tools.py renders them into a system preamble."""
        return self._template_mentions("tools")

    def _template_mentions(self, word: str) -> bool:
        template = self.tokenizer.chat_template
        return isinstance(template, str) and word in template

    # ------------------------------------------------------------------ shared path
    def _validate(self, body, prompt_ids: list[int], max_tokens: int, logprobs: int | None) -> dict:
        if not prompt_ids:
            raise invalid("the prompt is empty", "prompt")
        limit = self.info.max_model_len
        if len(prompt_ids) >= limit:
            raise invalid(f"the prompt has {len(prompt_ids)} tokens; this model's context is {limit} tokens "
                          f"(prompt plus at least one output token)",
                          "messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                          "context_length_exceeded")
        if isinstance(max_tokens, int) and max_tokens > 0 and len(prompt_ids) + max_tokens > limit:
            raise invalid(f"prompt ({len(prompt_ids)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                          f"context of {limit} tokens", "max_tokens", "context_length_exceeded")
        params = body.sampling_params(max_tokens, logprobs)
        try:
            SamplingParams(**params)
        except TandemError as e:
            raise APIError.from_tandem(e) from e
        return params

    def _check_choices(self, body, num_prompts: int) -> int:
        """How many engine requests the response needs (prompts times n); a 400 if it could never fit."""
        if body.n < 1:
            raise invalid(f"n must be at least 1, got {body.n}", "n")
        count = num_prompts * body.n
        if count > self.cfg.max_inflight:
            raise invalid(f"{num_prompts} prompt(s) times n={body.n} is {count} completions; this server runs at "
                          f"most {self.cfg.max_inflight} at once", "n" if body.n > 1 else "prompt")
        return count

    async def _generate(self, body, request: Request, prompts: list[tuple[list[int], str]], max_tokens: int,
                        logprobs: int | None, chat: bool, tools=None, whole_as=None, stream_as=None):
        """prompts: (token ids, echoed text) each; whole_as / stream_as: reshape the whole body / the SSE
        stream (the Responses API's)."""
        arrival = time.monotonic()
        endpoint = "chat" if chat else "completions"
        try:
            count = self._check_choices(body, len(prompts))
            params = [self._validate(body, ids, max_tokens, logprobs) for ids, _ in prompts]
        except APIError as e:
            self.metrics.request_done(endpoint, e.status)
            raise
        if self.inflight + count > self.cfg.max_inflight:
            self.metrics.rejected.inc()
            self.metrics.request_done(endpoint, 429)
            raise APIError(429, f"the server is at its queue bound ({self.cfg.max_inflight} requests); retry later",
                           "rate_limit_error", code="overloaded")
        # Serve's proxy gives every request an id (the client's X-Request-Id if it sent one): reuse it so
        # the router's, the workers' and Serve's logs name the same request; a response of several choices
        # sends each as `<id>-<index>`.
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{request.headers.get('x-request-id') or uuid.uuid4().hex}"
        children = []  # (choice index, prompt index, Generation)
        for p, ((ids, _), prompt_params) in enumerate(zip(prompts, params)):
            for sample in range(body.n):
                index = p * body.n + sample
                child = dict(prompt_params)
                if "seed" in child:
                    child["seed"] = child_seed(child["seed"], sample)
                children.append((index, p, Generation(self.prefill, self.feeds, rid if count == 1 else f"{rid}-{index}",
                                                      ids, child, self.resume, self.cfg.local_prefill_max_tokens)))
        self.inflight += count
        self.waiting_first += count
        self._gauges()
        try:
            await start_all([gen for _, _, gen in children])
        except BaseException as e:
            self.inflight -= count
            self.waiting_first -= count
            self._gauges()
            if isinstance(e, APIError):
                self.metrics.request_done(endpoint, e.status)
            raise
        self.waiting_first -= count
        self.metrics.ttft.observe(time.monotonic() - arrival)
        prompt_tokens = sum(len(ids) for ids, _ in prompts)  # each prompt once, however many samples it has
        self.metrics.prompt_tokens.inc(prompt_tokens)
        writers = [ResponseWriter(self.output, self.sink, body, gen, rid, chat, prompts[p][1], logprobs,
                                  prompts[p][0], tools, index) for index, p, gen in children]
        out = Choices(self.sink, writers, prompt_tokens, rid, chat, arrival, endpoint,
                      body.stream_options if body.stream else None)
        headers = {"X-Request-Id": rid}
        if body.stream:
            events = out.sse() if stream_as is None else stream_as(out.sse())
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        shape = whole_as or (lambda answer: answer)
        try:
            if self.api_server is None:  # behind Serve's proxy, which cancels this call when the client goes
                return JSONResponse(shape(await out.collect()), headers=headers)
            answered, answer = await unless_client_leaves(request, out.collect())
            return JSONResponse(shape(answer), headers=headers) if answered else Response(status_code=499)
        except APIError as e:
            return e.response()

    def _choice_ended(self) -> None:
        self.inflight -= 1
        self._gauges()

    def _gauges(self) -> None:
        self.metrics.running.set(self.inflight)
        self.metrics.queue.set(self.waiting_first)

