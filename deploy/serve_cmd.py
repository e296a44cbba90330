"""`tandem serve`: deploy the router, prefill and decode deployments on Ray Serve and keep serving.

Embedded default: starts Ray in this process (SmolLM2-135M-Instruct with its MTP head drafting k=1,
one prefill replica, one decode group: tp=1 on a CPU with fewer than 8 cores, else two ranks) and serves on
127.0.0.1:8000. With --address it joins a running cluster (`ray up deploy/cluster.yaml`, then
`tandem serve --address auto --model DIR --device cuda`).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future

log = logging.getLogger("tandem.serve")


def parser() -> argparse.ArgumentParser:
    from deploy.config import TandemConfig
    from deploy.flags import add_model_flags

    ap = argparse.ArgumentParser(prog="tandem serve", description=__doc__.splitlines()[0])
    # Every deployment setting is a flag made from TandemConfig's fields; serving a named model changes two defaults.
    add_model_flags(ap, TandemConfig, aliases={"num_speculative_tokens": ("-k",)}, overrides={
        "model": dict(help="a named model (`tandem models list`), a model directory or a .gguf file "
                           "(default: smollm2-135m-instruct)"),
        "speculative_method": dict(default=None, help="speculative decoding method (default: mtp with the "
                                                      "model's own head when a named model has one; else none)"),
        "tp": dict(default=None, help="tensor-parallel ranks per decode group (default: 2; 1 for an embedded "
                                      f"CPU deployment on fewer than {SMALL_CPU_CORES} cores, see docs/serving.md)")})
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="compute every prompt from its first token (same as --enable-prefix-caching false)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only; 0.0.0.0 "
                                                       "exposes the API: set --api-key then)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--ingress", choices=("direct", "proxy"), default="direct",
                    help="how HTTP reaches the router: direct = each router replica answers on --host:--port itself "
                         "(no Serve proxy; replicas on one node share the port); proxy = Serve's HTTP proxy "
                         "forwards requests and relays every streamed chunk (default: direct; docs/serving.md)")
    ap.add_argument("--address", default=None, help="Ray address to join ('auto', 'host:6379'); default: "
                                                    "start Ray in this process")
    ap.add_argument("--num-cpus", type=int, default=None, help="embedded Ray's logical CPUs (default: enough "
                                                               "for the deployments)")
    ap.add_argument("--detach", action="store_true", help="with --address: deploy and exit (Serve keeps it)")
    return ap


# Below this many cores an embedded CPU deployment decodes with tp=1: the router, the proxy, the prefill
# and two ranks' all-reduces then fight over too few cores, and tp=1 served 1.4-2.7x the tokens/s of
# tp=2 on a 2-core machine (bench/served_vs_engine.py, same run).
SMALL_CPU_CORES = 8


def default_tp(device: str, address: str | None, cores: int | None = None) -> int:
    """The decode group's tp when the user gives none: the deployment's default, except on a small machine
    serving on its own CPU."""
    cores = cores if cores is not None else (os.cpu_count() or 1)
    if device == "cpu" and address is None and cores < SMALL_CPU_CORES:
        return 1
    return 2


def _named_defaults(args: argparse.Namespace, name: str) -> dict:
    """Serving a named model (zoo/models.py; the default is DEFAULT_MODEL): its target under its own name,
    drafting with its MTP head (when it has one) unless a speculative method was asked for, its own k unless -k,
    and the hot vocabulary shipped with that head (zoo/models.py token_maps) unless another draft or map is given."""
    from zoo.models import resolve

    print(f"loading {name}...", flush=True)
    paths = resolve(name)
    method = args.speculative_method or ("mtp" if "mtp" in paths.heads else "none")
    draft = args.draft or (str(paths.heads[method]) if method in paths.heads else None)
    chosen = dict(model=str(paths.target), served_model_name=args.served_model_name or name,
                  speculative_method=method, draft=draft)
    if method in ("mtp", "eagle3") and not args.num_speculative_tokens:  # 0: no -k given
        chosen["num_speculative_tokens"] = paths.default_k
    if method in paths.token_maps and not args.draft and not getattr(args, "speculative_token_map", None):
        chosen["speculative_token_map"] = str(paths.token_maps[method])  # the map shipped with that very head
    return chosen


def _gguf_defaults(args: argparse.Namespace) -> dict:
    """A GGUF file is converted here, once, so that every actor loads the converted directory."""
    from pathlib import Path

    from engine.models.gguf import gguf_model_dir

    print(f"converting {args.model} (once per file content)...", flush=True)
    return dict(model=str(gguf_model_dir(args.model)), served_model_name=args.served_model_name or Path(args.model).stem)


def tandem_config(args: argparse.Namespace):
    from deploy.config import TandemConfig
    from deploy.flags import model_kwargs

    chosen = model_kwargs(args, TandemConfig)
    if args.no_prefix_caching:
        chosen["enable_prefix_caching"] = False
    if args.tp is None:
        chosen["tp"] = default_tp(chosen.get("device", "cpu"), args.address)
    from engine.models.gguf import is_gguf
    from zoo.models import DEFAULT_MODEL, is_name

    if args.model is None or is_name(args.model):
        chosen.update(_named_defaults(args, args.model or DEFAULT_MODEL))
    elif is_gguf(args.model):
        chosen.update(_gguf_defaults(args))
    return TandemConfig(**chosen)


def usage_text(host: str, port: int, model: str, with_key: bool = False) -> str:
    """What to try first; `with_key`: the server needs the API key (the examples read $TANDEM_API_KEY)."""
    base = f"http://{host}:{port}"
    auth = " -H \"Authorization: Bearer $TANDEM_API_KEY\"" if with_key else ""
    key = "os.environ['TANDEM_API_KEY']" if with_key else "'none'"
    return f"""
Tandem is serving {model!r} at {base}{' (API key required on every route but /health)' if with_key else ''}

  curl {base}/v1/completions -H 'Content-Type: application/json'{auth} \\
       -d '{{"model": "{model}", "prompt": "Hello", "max_tokens": 32, "temperature": 0}}'

  curl -N {base}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\
       -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello"}}], "stream": true}}'

  python -c "import os; from openai import OpenAI; c = OpenAI(base_url='{base}/v1', api_key={key}); \\
print(c.completions.create(model='{model}', prompt='Hello', max_tokens=32).choices[0].text)"

  metrics: curl {base}/metrics     health: curl {base}/health     models: curl {base}/v1/models
Ctrl-C stops serving.
"""


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = tandem_config(args)
    except Exception as e:  # noqa: BLE001 - configuration errors are the user's to fix: say why, no trace
        print(f"tandem serve: {e}", file=sys.stderr)
        return 2

    api = (args.host, args.port) if args.ingress == "direct" else None
    taken = _taken(api) if api is not None and args.address is None else None
    if taken is not None:  # said now, not after a minute of deploying (the router replica would fail to bind)
        print(f"tandem serve: {taken}", file=sys.stderr)
        return 1

    from ray import serve

    from cluster.runtime import RayOptions, init_ray, shutdown_ray
    from deploy.app import application

    stop = threading.Event()
    # Ctrl-C and SIGTERM only set the event, from the start: a KeyboardInterrupt raised while Serve waited for
    # the deployment ended in a traceback, or was swallowed there and the server came up and ran on until a
    # second Ctrl-C; one raised inside Event.wait can land in the lock's own bookkeeping ("release unlocked
    # lock"). Each skipped the orderly shutdown below.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    needed = int(cfg.prefill_replicas * cfg.prefill_num_cpus + cfg.decode_replicas * cfg.tp * cfg.rank_num_cpus) + 1
    # An embedded Ray is one node: it declares the custom resources the config asks for (node kinds of a
    # cluster), so that a configuration written for a cluster also runs here instead of pending forever.
    init_ray(RayOptions(address=args.address, num_cpus=args.num_cpus or max(os.cpu_count() or 1, needed),
                        resources=cfg.custom_resources_needed() or None))
    # Direct: no proxy, the router replicas take --host:--port themselves (http_options then only name it in
    # Serve's logs).
    serve.start(proxy_location="Disabled" if api else None, http_options={"host": args.host, "port": args.port})
    start = time.monotonic()
    print(f"deploying: 1 router, {cfg.prefill_replicas} prefill, {cfg.decode_replicas} decode group(s) of "
          f"tp={cfg.tp} on {cfg.device}...", flush=True)
    # serve.run waits until every replica is up (or forever, for resources nobody has): on another thread, so
    # that a stop signal ends the wait too.
    deploying = _on_a_thread(lambda: serve.run(application(cfg, api), name="tandem", route_prefix="/"))
    while not stop.is_set() and not deploying.done():
        stop.wait(0.2)
    code = 0
    if not stop.is_set() and deploying.exception() is not None:
        print(f"tandem serve: the deployment failed: {_failure_reason('tandem') or deploying.exception()}",
              file=sys.stderr)
        code = 1
    elif not stop.is_set():
        print(f"ready in {time.monotonic() - start:.1f}s", flush=True)
        print(usage_text(args.host, args.port, cfg.name, cfg.api_key is not None), flush=True)
        if args.detach and args.address is not None:
            return 0
        while not stop.wait(1.0):
            pass
    print("shutting down" if deploying.done() else "stopped while deploying: shutting down", flush=True)
    if args.address is None:  # the embedded Ray, and Serve on it, are this command's
        serve.shutdown()
        shutdown_ray()
    else:  # on a cluster, other applications may share Serve: only the one deployed here goes
        serve.delete("tandem")
    return code


def _taken(api: tuple[str, int]) -> str | None:
    """Why this machine's router replica could not listen on the API address (naming it, with the OS's
    reason), or None: a trial bind the way the replica binds (router/ingress.py), released at once. On a
    cluster the replica may run on another node, so only the embedded default checks."""
    from router.ingress import reuse_port_socket

    try:
        reuse_port_socket(*api).close()
    except OSError as e:
        return e.strerror
    return None


def _failure_reason(app: str) -> str | None:
    """Why Serve gave up on the application's deployments: the last line of each failed one's message (a
    replica's constructor error ends with its exception, e.g. a taken port), else None."""
    from ray import serve

    try:
        deployments = serve.status().applications[app].deployments
    except Exception:  # noqa: BLE001 - no status to read: the caller reports the exception it has
        return None
    reasons = []
    for name, status in deployments.items():
        lines = [line.strip() for line in (status.message or "").splitlines() if line.strip()]
        if str(status.status).endswith(("DEPLOY_FAILED", "UNHEALTHY")) and lines:
            reasons.append(f"{name}: {lines[-1]}")
    return "; ".join(reasons) or None


def _on_a_thread(fn) -> Future:
    """fn() run on a daemon thread; its outcome in the future."""
    done: Future = Future()

    def run():
        try:
            done.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            done.set_exception(e)

    threading.Thread(target=run, daemon=True, name="tandem-deploy").start()
    return done
