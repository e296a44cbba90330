"""`tandem serve`: flags become the deployment config, bad flags fail with a message (exit 2), and the
printed instructions are valid curl / openai usage for the served model."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from deploy.serve_cmd import parser, tandem_config, usage_text


def test_flags_map_onto_the_deployment_config(tiny_model_dir):
    args = parser().parse_args(["--model", tiny_model_dir, "--tp", "2", "--prefill-replicas", "2",
                                "--decode-replicas", "3", "--port", "8011", "--max-num-seqs", "32",
                                "--served-model-name", "m"])
    cfg = tandem_config(args)
    assert (cfg.tp, cfg.prefill_replicas, cfg.decode_replicas, cfg.name) == (2, 2, 3, "m")
    assert cfg.decode().tp == 2 and cfg.decode().max_num_seqs == 32
    assert cfg.prefill().block_size == cfg.decode().block_size == 16
    assert cfg.router().served_model_name == "m"


def test_switches_take_true_or_false(tiny_model_dir):
    """A bool setting (async_scheduling) is written as its YAML value is; anything else is a usage error."""
    for text, value in (("true", True), ("False", False), ("1", True), ("off", False)):
        cfg = tandem_config(parser().parse_args(["--model", tiny_model_dir, "--async-scheduling", text]))
        assert cfg.decode().async_scheduling is value and cfg.decode().engine_config().async_scheduling is value
    with pytest.raises(SystemExit):
        parser().parse_args(["--model", tiny_model_dir, "--async-scheduling", "maybe"])


def test_every_deployment_setting_is_a_flag_with_its_help():
    from deploy.config import TandemConfig

    actions = {a.dest: a for a in parser()._actions}
    for name, info in TandemConfig.model_fields.items():
        assert name in actions and actions[name].option_strings[-1] == "--" + name.replace("_", "-"), name
        if name not in ("model", "speculative_method", "tp"):  # the zoo's, and the machine's (tp)
            assert info.description in actions[name].help and actions[name].default == info.default, name
    assert "-k" in actions["num_speculative_tokens"].option_strings
    assert actions["device"].choices == ["cpu", "cuda"]


def test_defaults_are_the_embedded_setup():
    args = parser().parse_args([])
    assert (args.host, args.port, args.tp, args.prefill_replicas, args.decode_replicas, args.address,
            args.device) == ("127.0.0.1", 8000, None, 1, 1, None, "cpu")


def test_tp_default_follows_the_machine():
    from deploy.serve_cmd import default_tp

    assert default_tp("cpu", None, cores=2) == 1  # a small box serving itself: no all-reduce over 2 cores
    assert default_tp("cpu", None, cores=32) == 2
    assert default_tp("cpu", "auto", cores=2) == 2  # a cluster: the deployment's default
    assert default_tp("cuda", None, cores=2) == 2


@pytest.mark.slow
def test_serving_a_named_model_drafts_with_its_mtp_head_by_default(zoo_dir):
    import zoo

    cfg = tandem_config(parser().parse_args(["--model", "tandem-tiny"]))
    paths = zoo.layout(zoo.build())  # what `tandem serve` resolves: the default zoo (zoo_dir built it)
    assert cfg.name == "tandem-tiny" and cfg.model == str(paths.target)
    assert cfg.decode().speculative == {"method": "mtp", "k": 3, "draft": str(paths.mtp)}
    eagle = tandem_config(parser().parse_args(["--model", "tandem-tiny", "--speculative-method", "eagle3", "-k", "2"]))
    assert eagle.prefill().speculative == {"method": "eagle3", "k": 2, "draft": str(paths.eagle3)}
    plain = tandem_config(parser().parse_args(["--model", "tandem-tiny", "--speculative-method", "none"]))
    assert plain.decode().speculative is None


def test_the_default_model_is_smollm2_with_its_own_heads(smollm2_dir):
    from zoo.models import resolve

    cfg = tandem_config(parser().parse_args([]))
    paths = resolve("smollm2-135m-instruct")
    assert cfg.name == "smollm2-135m-instruct" and cfg.model == str(paths.target) == smollm2_dir
    if "mtp" in paths.heads:
        want = {"method": "mtp", "k": paths.default_k, "draft": str(paths.heads["mtp"])}
        if "mtp" in paths.token_maps:  # the head's own hot vocabulary comes with it
            want["token_map"] = str(paths.token_maps["mtp"])
        assert cfg.decode().speculative == want
        with_k = tandem_config(parser().parse_args(["-k", "2"]))
        assert with_k.decode().speculative["k"] == 2  # -k wins over the model's own k
    else:
        assert cfg.decode().speculative is None


def test_speculation_flags_reach_both_engines_and_are_checked_early(tiny_model_dir):
    args = parser().parse_args(["--model", tiny_model_dir, "--speculative-method", "ngram", "-k", "4"])
    cfg = tandem_config(args)
    assert cfg.prefill().speculative == cfg.decode().speculative == {"method": "ngram", "k": 4, "draft": None}
    with pytest.raises(ValueError, match="draft"):
        tandem_config(parser().parse_args(["--model", tiny_model_dir, "--speculative-method", "eagle3"]))
    with pytest.raises(ValueError, match="k must"):
        tandem_config(parser().parse_args(["--model", tiny_model_dir, "--speculative-method", "ngram", "-k", "99"]))


def test_draft_tree_flags_reach_the_engines_and_bad_sizes_name_the_field(tiny_model_dir):
    base = ["--model", tiny_model_dir, "--speculative-method", "mtp", "-k", "3"]
    cfg = tandem_config(parser().parse_args(base + ["--speculative-topk", "4", "--num-verify-tokens", "10"]))
    assert cfg.decode().speculative == {"method": "mtp", "k": 3, "draft": None, "topk": 4, "num_verify_tokens": 10}
    assert "topk" not in tandem_config(parser().parse_args(base)).decode().speculative  # the chain by default
    with pytest.raises(ValueError, match="num_verify_tokens"):
        tandem_config(parser().parse_args(base + ["--speculative-topk", "2", "--num-verify-tokens", "7"]))
    with pytest.raises(ValueError, match="topk"):
        tandem_config(parser().parse_args(base + ["--speculative-topk", "9"]))


@pytest.mark.parametrize("argv, message", [
    (["--model", "/nonexistent/dir"], "not a model directory"),
    (["--model", ".", "--tp", "0"], "tp"),
])
def test_bad_flags_exit_2_with_a_message(argv, message):
    proc = subprocess.run([sys.executable, "-m", "deploy.cli", "serve", *argv], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_help_lists_the_flags():
    proc = subprocess.run([sys.executable, "-m", "deploy.cli", "serve", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0
    for flag in ("--model", "--draft", "--speculative-method", "--num-speculative-tokens", "--tp",
                 "--prefill-replicas", "--decode-replicas", "--host", "--port", "--address"):
        assert flag in proc.stdout


def test_usage_text_names_the_endpoints():
    text = usage_text("127.0.0.1", 8000, "tiny")
    assert "curl http://127.0.0.1:8000/v1/completions" in text and '"model": "tiny"' in text
    assert "OpenAI(base_url='http://127.0.0.1:8000/v1'" in text and "/metrics" in text


def test_router_limits_and_the_api_key_flow_from_flags_or_the_environment(tiny_model_dir, monkeypatch):
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    base = ["--model", tiny_model_dir]
    cfg = tandem_config(parser().parse_args(base + ["--max-inflight", "7", "--max-body-bytes", "65536"]))
    assert (cfg.router().max_inflight, cfg.router().max_body_bytes, cfg.router().api_key) == (7, 65536, None)
    monkeypatch.setenv("TANDEM_API_KEY", "from-env")
    assert tandem_config(parser().parse_args(base)).router().api_key == "from-env"
    cfg = tandem_config(parser().parse_args(base + ["--api-key", "from-flag"]))
    assert cfg.router().api_key == "from-flag" and "from-flag" not in repr(cfg)
    assert "api_key" not in cfg.prefill().model_dump() and "api_key" not in cfg.decode().model_dump()
    text = usage_text("127.0.0.1", 8000, "tiny", with_key=True)
    assert 'Authorization: Bearer $TANDEM_API_KEY' in text


def _tandem_serve(port: int, ray_tmp: str, *flags: str) -> subprocess.Popen:
    """`tandem serve` as a user starts it, with an embedded Ray of its own (in `ray_tmp`: Ray's socket paths
    must fit in 107 bytes, so not under pytest's long tmp_path)."""
    return subprocess.Popen([sys.executable, "-m", "deploy.cli", "serve", "--port", str(port), "--num-cpus", "4",
                             *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "RAY_TMPDIR": ray_tmp})


def _finish(proc: subprocess.Popen, timeout_s: float = 180) -> str:
    """The rest of its output once it exits; killed if it does not."""
    try:
        return proc.communicate(timeout=timeout_s)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.slow
@pytest.mark.parametrize("when", ["deploying", "serving"])
def test_ctrl_c_stops_tandem_serve_while_deploying_and_while_serving(when, tiny_model_dir):
    """The whole command: Ctrl-C ends it with an orderly shutdown whenever it comes. Regression: a Ctrl-C
    during the deployment (~10 s on CPU) was raised inside Serve's wait (a traceback, no shutdown) or
    swallowed there, and the server came up and ran on. While deploying: the default model, whose deployment
    leaves the signal time to come; while serving: the tiny model (the shutdown is the same, its start-up
    shorter)."""
    import signal

    import httpx

    from cluster.rendezvous import free_port_on

    port = free_port_on("127.0.0.1")
    ray_tmp = tempfile.mkdtemp(prefix="tandem-serve-")
    model = () if when == "deploying" else ("--model", tiny_model_dir, "--served-model-name", "tiny")
    proc = _tandem_serve(port, ray_tmp, *model)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if (when == "deploying" and line.startswith("deploying:")) or line.startswith("Ctrl-C stops serving"):
                break
        assert lines and proc.poll() is None, "".join(lines)
        if when == "serving":
            answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0})
            assert answer.status_code == 200, answer.text
        proc.send_signal(signal.SIGINT)
        rest = _finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    said = "stopped while deploying: shutting down" if when == "deploying" else "shutting down"
    assert proc.returncode == 0 and said in rest, "".join(lines) + rest
    with pytest.raises(httpx.TransportError):  # nothing serves there any more
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)


def test_a_taken_port_fails_tandem_serve_at_once_with_the_reason():
    """Another program holds the port: exit 1 with the OS's reason in one line, before Ray starts (it used to
    deploy everything for about a minute and then report the router replica's failure to bind)."""
    import socket

    ray_tmp = tempfile.mkdtemp(prefix="tandem-serve-")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = _tandem_serve(port, ray_tmp)
        try:
            out = _finish(proc)
        finally:
            shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 1, out
    assert f"tandem serve: the router cannot serve the API on 127.0.0.1:{port}: Address already in use" in out, out
    assert "deploying:" not in out, out  # refused before Ray started, not after the deployment


def test_prefix_caching_is_on_unless_turned_off(tiny_model_dir):
    on = tandem_config(parser().parse_args(["--model", tiny_model_dir]))
    assert on.prefill().enable_prefix_caching and on.decode().enable_prefix_caching
    for off in (["--no-prefix-caching"], ["--enable-prefix-caching", "false"]):
        cfg = tandem_config(parser().parse_args(["--model", tiny_model_dir, *off]))
        assert not cfg.prefill().enable_prefix_caching and not cfg.decode().enable_prefix_caching
        assert not cfg.prefill().engine_config().enable_prefix_caching
