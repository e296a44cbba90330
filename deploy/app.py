"""The Serve application: router -> (prefill, decode). `build_app` is the import path of the Serve
config YAML (`serve deploy deploy/serve.yaml`), where HTTP comes through Serve's proxies; `tandem serve`
calls `application`, by default with `api` (direct ingress: the router replicas answer HTTP themselves)."""
from __future__ import annotations

from ray import serve
from ray.serve.config import RequestRouterConfig

from decode_worker.deployment import DecodeServer
from deploy.config import TandemConfig
from prefill_worker.deployment import PrefillServer
from router.app import Router
from router.policy import STATS_PERIOD_S
from router.request_router import LoadAwareRequestRouter


def _routing(role: str, prefix_aware: bool = True) -> RequestRouterConfig:
    return RequestRouterConfig(request_router_class=LoadAwareRequestRouter,
                               request_router_kwargs={"role": role, "prefix_aware": prefix_aware},
                               request_routing_stats_period_s=STATS_PERIOD_S)


def build_app(args: dict | TandemConfig) -> serve.Application:
    """The Serve YAML's builder (Serve requires exactly one parameter): HTTP through Serve's proxies."""
    return application(args if isinstance(args, TandemConfig) else TandemConfig(**args))


def application(cfg: TandemConfig, api: tuple[str, int] | None = None) -> serve.Application:
    """api: (host, port) for direct ingress (router/ingress.py); None: through Serve's HTTP proxy."""
    prefill = serve.deployment(
        PrefillServer, name="prefill", num_replicas=cfg.prefill_replicas,
        ray_actor_options={"num_cpus": cfg.prefill_num_cpus, "num_gpus": cfg.prefill_gpus(),
                           "resources": dict(cfg.prefill_resources)},
        max_ongoing_requests=cfg.max_num_seqs * 2, request_router_config=_routing("prefill", cfg.prefix_aware_routing),
        health_check_period_s=5, graceful_shutdown_timeout_s=5,
    ).bind(cfg.prefill().model_dump())
    # The decode replica itself only steers its rank actors (which hold the CPUs/GPUs and rank_resources); it
    # goes where the routers go, so that a decode node lost takes its ranks (rebuilt), not the replica.
    control = {"num_cpus": 0, "resources": dict(cfg.router_resources)}
    decode = serve.deployment(
        DecodeServer, name="decode", num_replicas=cfg.decode_replicas, ray_actor_options=control,
        max_ongoing_requests=cfg.max_num_seqs * 4, request_router_config=_routing("decode", cfg.prefix_aware_routing),
        health_check_period_s=5, graceful_shutdown_timeout_s=5,
    ).bind(cfg.decode().model_dump())
    router = serve.deployment(
        Router, name="router", num_replicas=cfg.router_replicas, ray_actor_options=control,
        max_ongoing_requests=cfg.max_inflight * 2, graceful_shutdown_timeout_s=5,
    )
    return router.bind(prefill, decode, cfg.router(api).model_dump())
