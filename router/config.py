"""The ingress's settings at the deployment boundary. RouterSettings are the router's own knobs (also
`tandem serve` flags and Serve YAML `args`, through deploy.config.TandemConfig, which extends it);
RouterConfig adds what the deployment builder fills in (the model's directory and served name)."""
from __future__ import annotations

from pydantic import BaseModel, Field

API_KEY_ENV = "TANDEM_API_KEY"  # read by deploy.config.TandemConfig when --api-key is not given


class RouterSettings(BaseModel):
    max_inflight: int = Field(256, ge=1, description="Requests one router replica serves at once; more get "
                                                     "HTTP 429 with Retry-After (the admission bound).")
    max_stop_strings: int = Field(4, ge=0, description="Most stop strings per request.")
    max_stop_string_chars: int = Field(256, ge=1, description="Longest stop string, in characters.")
    max_logprobs: int = Field(20, ge=0, description="Most log-probabilities per token (completions `logprobs`, "
                                                    "chat `top_logprobs`).")
    max_body_bytes: int = Field(4 * 2**20, ge=1024, description="Largest request body; larger ones get HTTP 413, "
                                                               "refused from Content-Length before reading.")
    metrics_port: int | None = Field(None, ge=1, le=65535, description="Serve /metrics on this port (at "
                                                                       "metrics_host) instead of the API port, "
                                                                       "which then answers /metrics with 404; "
                                                                       "router replicas sharing a node take the "
                                                                       "next free ports.")
    metrics_host: str = Field("127.0.0.1", description="Address the metrics port binds (with metrics_port).")
    feed_link: bool = Field(True, description="Read the decode replicas' per-step token batches over a TCP "
                                              "connection to each (cluster/feed_link.py); false: as Ray Serve "
                                              "streams (more CPU per step on both sides), for networks "
                                              "where the router cannot reach the decode replicas' nodes "
                                              "directly.")
    shutdown_grace_s: float = Field(3.0, ge=0, le=4.0, description="When a router replica stops (deleted, scaled "
                                                                 "down, replaced), its open responses get this "
                                                                 "long to end before they are cut; within Serve's "
                                                                 "5 s graceful shutdown.")
    prefix_aware_routing: bool = Field(True, description="Send each prompt to the prefill replica that holds "
                                                         "the longest cached prefix of it, and to the decode "
                                                         "replica whose group holds most of it, weighed against "
                                                         "load (router/policy.py); false: by load alone, "
                                                         "equal replicas in turn.")
    local_prefill_max_tokens: int = Field(128, ge=0, description="Conditional disaggregation: a request whose "
                                                                   "decode group already holds its prompt's "
                                                                   "leading blocks (an earlier request's: a shared "
                                                                   "system prompt, the previous turn of a chat) and "
                                                                   "lacks at most this many of its tokens is "
                                                                   "prefilled by that group itself, without a "
                                                                   "prefill replica or a KV hand-over (not guided "
                                                                   "requests nor prompt logprobs); 0: always "
                                                                   "disaggregated.")
    resume_attempts: int = Field(3, ge=0, description="When a worker dies under a request (a decode rank or "
                                                      "replica, a prefill replica, a KV hand-over), submit it "
                                                      "again as a continuation of what its client was sent, up "
                                                      "to this many times: the stream goes on after a pause, "
                                                      "with the same tokens (router/generation.py); 0: the "
                                                      "request ends with a 503 as before.")
    resume_deadline_s: float = Field(120.0, gt=0, description="Longest pause of one resumption, from the "
                                                              "failure to the next token; past it the request "
                                                              "ends with its 503.")
    api_key: str | None = Field(None, repr=False, description=f"Bearer key every route but /health requires "
                                                              f"(HTTP 401 otherwise); default: ${API_KEY_ENV}, "
                                                              f"else no key.")


class RouterConfig(RouterSettings):
    model: str = Field(description="Model directory: its tokenizer and chat template are used here.")
    served_model_name: str = Field(description="The name clients put in the `model` field.")
    api_port: int | None = Field(None, ge=1, le=65535, description="Direct ingress (router/ingress.py): each "
                                                                   "router replica answers HTTP itself on "
                                                                   "api_host:api_port (replicas sharing a node "
                                                                   "share the port); None: requests come through "
                                                                   "Serve's HTTP proxy.")
    api_host: str = Field("127.0.0.1", description="Address the direct-ingress port binds (with api_port).")
