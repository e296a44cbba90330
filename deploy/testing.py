"""Test support: one Tandem Serve application per test session (router + prefill + a tp=2 decode group
on the session's Ray), shared by every test folder that needs the HTTP API. Like cluster.testing's
Ray, the fixture counts its users so that the last one shuts Serve down."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from cluster.rendezvous import free_port_on

_server = None
_users = 0


@dataclass(frozen=True)
class TandemServer:
    base_url: str  # http://127.0.0.1:PORT: the router replica's own port (direct ingress), or Serve's proxy
    model_dir: str
    model: str  # the served model name
    config: object  # deploy.config.TandemConfig
    app: str = "tandem"  # the Serve application's name
    proxy_url: str = ""  # http://127.0.0.1:PORT: Serve's HTTP proxy (every application, under its route prefix)

    def openai(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="none", max_retries=0, **kwargs)

    def async_openai(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.base_url}/v1", api_key="none", max_retries=0, **kwargs)

    def decode_handle(self):
        from ray import serve

        return serve.get_deployment_handle("decode", app_name=self.app)

    def prefill_handle(self):
        from ray import serve

        return serve.get_deployment_handle("prefill", app_name=self.app)

    def kv_blocks_in_use(self) -> dict[str, int]:
        """KV blocks in use per worker from the deployments' own stats (one replica of each):
        {"prefill": n, "decode/rank0": n, ...}; a decode rank's figure is from its last step report."""
        prefill = self.prefill_handle().stats.remote().result()
        decode = self.decode_handle().stats.remote().result()
        return {"prefill": prefill["kv_blocks_used"],
                **{f"decode/rank{r}": load[1] for r, load in enumerate(decode["dp_ranks"])}}


def _ingress(server_proxy_url: str, name: str, ingress: str) -> tuple[tuple[str, int] | None, str]:
    """(the router's direct-ingress address or None, the base URL its clients use) for an application `name`."""
    if ingress == "proxy":
        return None, f"{server_proxy_url}/{name}" if name != "tandem" else server_proxy_url
    port = free_port_on("127.0.0.1")
    return ("127.0.0.1", port), f"http://127.0.0.1:{port}"


def start_server(model_dir: str, ingress: str = "direct", **overrides) -> TandemServer:
    """The session's application, as `tandem serve` runs it (direct ingress, unless `ingress="proxy"`); Serve's
    HTTP proxy runs too (`proxy_url`), so that tests can reach any application through it as well."""
    from ray import serve

    from deploy.app import application
    from deploy.config import TandemConfig

    proxy_url = f"http://127.0.0.1:{free_port_on('127.0.0.1')}"
    serve.start(http_options={"host": "127.0.0.1", "port": int(proxy_url.rsplit(':', 1)[1])})
    cfg = TandemConfig(**{"model": model_dir, "served_model_name": "tiny", "tp": 2, "num_kv_blocks": 256,
                          "max_num_seqs": 64, "max_inflight": 40, **overrides})
    api, base_url = _ingress(proxy_url, "tandem", ingress)
    serve.run(application(cfg, api), name="tandem", route_prefix="/")
    return TandemServer(base_url, model_dir, cfg.name, cfg, proxy_url=proxy_url)


def start_router(server: TandemServer, name: str, ingress: str = "direct", num_replicas: int = 1,
                 **router_settings) -> TandemServer:
    """A second router, with its own settings (small limits, an API key), on `server`'s prefill and decode
    deployments: an application of `num_replicas` router replicas (on a port of their own, or under the route
    prefix `/name` of Serve's proxy with `ingress="proxy"`), so tests of limits cost no second engine. Stop it
    with `stop_router(name)`."""
    from ray import serve

    from deploy.config import TandemConfig
    from router.app import Router

    cfg = TandemConfig(**{**server.config.model_dump(), **router_settings})
    prefill = serve.get_deployment_handle("prefill", app_name="tandem")
    decode = serve.get_deployment_handle("decode", app_name="tandem")
    app = serve.deployment(Router, name=f"router-{name}", num_replicas=num_replicas,
                           ray_actor_options={"num_cpus": 0}, max_ongoing_requests=cfg.max_inflight * 2 + 8,
                           graceful_shutdown_timeout_s=5)
    api, base_url = _ingress(server.proxy_url, name, ingress)
    serve.run(app.bind(prefill, decode, cfg.router(api).model_dump()), name=name, route_prefix=f"/{name}")
    return TandemServer(base_url, server.model_dir, cfg.name, cfg, proxy_url=server.proxy_url)


def start_app(server: TandemServer, name: str, ingress: str = "direct", **overrides) -> TandemServer:
    """A whole second application (router, prefill, decode group) with its own settings (`overrides` of
    `server`'s), on a port of its own (or under the route prefix `/name` of Serve's proxy): for tests that
    need a small KV cache, short deadlines or armed fault points without touching the session's application.
    Its deployments hold Ray CPUs like the session's: stop it with `stop_app(name)` before the next one starts."""
    from ray import serve

    from deploy.app import application
    from deploy.config import TandemConfig

    cfg = TandemConfig(**{**server.config.model_dump(), **overrides})
    api, base_url = _ingress(server.proxy_url, name, ingress)
    serve.run(application(cfg, api), name=name, route_prefix=f"/{name}")
    return TandemServer(base_url, server.model_dir, cfg.name, cfg, app=name, proxy_url=server.proxy_url)


def wait_decode_settled(app: str, what: str = "every KV block is back") -> dict:
    """The decode deployment's stats once it holds no request and no KV block (its hand-over stock's blocks
    count as free); AssertionError naming `what` if that does not happen within two minutes."""
    from ray import serve

    from cluster.testing import wait_for

    decode = serve.get_deployment_handle("decode", app_name=app)

    def settled():
        s = decode.stats.remote().result()
        return s if s["num_requests"] == 0 and s["kv_blocks_used"] == 0 else None

    return wait_for(settled, what, poll_s=0.2)


def stop_router(name: str) -> None:
    from ray import serve

    serve.delete(name)


stop_app = stop_router  # both delete the Serve application of that name


@pytest.fixture(scope="session")
def tandem_server(ray_session, tiny_model_dir):
    global _server, _users
    if _server is None:
        _server = start_server(tiny_model_dir)
    _users += 1
    yield _server
    _users -= 1
    if _users == 0:
        from ray import serve

        serve.shutdown()
        _server = None
