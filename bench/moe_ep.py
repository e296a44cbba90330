"""Expert parallelism's cost on CPU: tp=2 over gloo with the routed experts sharded whole (EP: each rank runs its
own experts on the (token, choice) pairs routed to them) against the same tp=2 with every expert sharded along
its intermediate dim (plain TP), same model, same requests, in one run.

Both layouts end each MoE layer in the same one all-reduce of [tokens, hidden], so the difference is the expert
compute's shape: EP runs half the experts at their full width (fewer, larger grouped GEMMs, and a rank may get
more or fewer pairs than its half); TP runs every hit expert at half width. Two processes (one torch thread
each, as a decode group's ranks run on this 2-core machine), each holding both engines; the layouts take turns
round by round (order alternating) and each reports the median decode-step time over its rounds' steps.

Models: the zoo's trained `tandem-tiny-moe` (8 experts, top 2, hidden 128) and a random wider DeepSeek-V3
(32 experts of 256, top 4, hidden 512), where expert compute weighs more.

    python -m bench.moe_ep [--batches 1,8] [--rounds 5] [--max-tokens 24] [--quick]
"""
from __future__ import annotations

import argparse
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import device_name, write_results

LAYOUTS = ("tp", "ep")


def wide_deepseek(path: Path, tokenizer_from: str) -> str:
    """A random DeepSeek-V3 with more and wider experts than the zoo's (expert compute dominates its MoE), with the
    tokenizer of `tokenizer_from` (a 2048-token vocabulary)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=2048, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, n_shared_experts=1,
                           n_routed_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2,
                           routed_scaling_factor=2.5, kv_lora_rank=64, q_lora_rank=128, qk_rope_head_dim=16,
                           qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=1, norm_topk_prob=True,
                           max_position_embeddings=2048, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    DeepseekV3ForCausalLM(cfg).eval().save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).write_bytes((Path(tokenizer_from) / name).read_bytes())
    return str(path)


def _prompts(batch: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(batch)
    return [torch.randint(10, 2000, (32,), generator=g).tolist() for _ in range(batch)]


def _run(engine, prompts, max_tokens: int, group) -> tuple[list[float], dict[int, list[int]]]:
    """Every prompt on both ranks (tp): -> (decode step seconds, outputs). Steps after the first are decode."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    times, done, first = [], {}, True
    while True:
        busy = torch.tensor([int(engine.has_unfinished())])
        dist.all_reduce(busy, group=group)
        if not busy.item():
            return times, done
        start = time.perf_counter()
        outs = engine.step()
        if not first:
            times.append(time.perf_counter() - start)
        first = False
        done.update({int(o.request_id): o.token_ids for o in outs if o.finished})


def _experts_ms(engines: dict, tokens: int, calls: int = 30) -> dict[str, float]:
    """One routed-experts module of each layout alone (this rank's shard, no collective), on the same `tokens`
    tokens routed uniformly at random: median ms per forward, layouts alternating call by call."""
    from engine.layers.moe import RoutedExperts

    experts = {lay: next(m for m in e.runner.model.modules() if isinstance(m, RoutedExperts))
               for lay, e in engines.items()}
    e0 = experts["tp"]
    top_k = engines["tp"].model_cfg.moe.top_k
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, e0.w13.shape[2], generator=g)
    ids = torch.rand(tokens, e0.num_experts, generator=g).topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, generator=g)
    times = {lay: [] for lay in experts}
    with torch.inference_mode():
        for _ in range(calls):
            for lay, module in experts.items():
                start = time.perf_counter()
                module(x, weights, ids)
                times[lay].append(time.perf_counter() - start)
    return {lay: 1e3 * statistics.median(v) for lay, v in times.items()}


def _rank_main(rank: int, port: int, models: dict, args, queue) -> None:
    from engine import EngineConfig, LLMEngine

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        for model_name, model in models.items():
            engines = {lay: LLMEngine(EngineConfig(model=model, num_kv_blocks=256, tp_size=2, tp_rank=rank,
                                                   expert_parallel=lay == "ep"), tp_group=dist.group.WORLD)
                       for lay in LAYOUTS}
            for batch in args.batches:
                prompts = _prompts(batch)
                for lay in LAYOUTS:  # warm-up
                    _run(engines[lay], prompts[:1], 4, dist.group.WORLD)
                steps = {lay: [] for lay in LAYOUTS}
                medians = {lay: [] for lay in LAYOUTS}
                outputs = {}
                for r in range(args.rounds):
                    for lay in (LAYOUTS if r % 2 == 0 else LAYOUTS[::-1]):
                        times, done = _run(engines[lay], prompts, args.max_tokens, dist.group.WORLD)
                        steps[lay] += times
                        medians[lay].append(statistics.median(times))
                        outputs.setdefault(lay, done)
                queue.put((rank, model_name, batch, {lay: statistics.median(steps[lay]) for lay in LAYOUTS},
                           {"rounds": medians, "experts_ms": _experts_ms(engines, batch)},
                           outputs["tp"] == outputs["ep"]))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which would otherwise wait
        queue.put((rank, "error", repr(e), None, None, None))
        raise
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,8")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--quick", action="store_true", help="the zoo model only, 3 rounds")
    p.add_argument("--zoo-target", default=None, help="the tiny MoE target directory (default: tandem-tiny-moe's)")
    p.add_argument("--name", default="moe_ep_cpu")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.quick:
        args.rounds = 3

    from zoo.models import resolve

    tmp = tempfile.TemporaryDirectory()
    zoo_target = args.zoo_target or str(resolve("tandem-tiny-moe").target)
    models = {"tandem-tiny-moe": zoo_target}
    if not args.quick:
        models["wide random (32 experts x 256, top 4, H 512)"] = wide_deepseek(Path(tmp.name) / "wide", zoo_target)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, port, models, args, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    rows, experts = [], {}
    try:
        for _ in range(2 * len(models) * len(args.batches)):
            rank, model_name, batch, med, extra, same = queue.get(timeout=1800)
            if model_name == "error":
                raise RuntimeError(f"rank {rank} failed: {batch}")
            experts[(model_name, batch, rank)] = {k: round(v, 3) for k, v in extra["experts_ms"].items()}
            if rank == 0:
                rows.append(dict(model=model_name, batch=batch, tp_step_ms=round(1e3 * med["tp"], 2),
                                 ep_step_ms=round(1e3 * med["ep"], 2), ep_over_tp=round(med["ep"] / med["tp"], 3),
                                 tokens_equal=same, per_round_ms={k: [round(1e3 * v, 2) for v in vs]
                                                                  for k, vs in extra["rounds"].items()}))
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
        tmp.cleanup()
    for r in rows:  # one experts module alone, per rank: (TP ms, EP ms)
        r["experts_ms_by_rank"] = [experts[(r["model"], r["batch"], rank)] for rank in range(2)]
    table = "\n".join(
        [f"Expert parallelism vs TP-sharded experts, tp=2 over gloo ({device_name('cpu')}, one thread per rank, "
         f"{args.max_tokens} greedy tokens per request, median decode step over {args.rounds} alternating rounds)",
         "", "| model | batch | TP experts ms/step | EP ms/step | EP / TP | tokens equal |", "|---|---|---|---|---|---|"]
        + [f"| {r['model']} | {r['batch']} | {r['tp_step_ms']} | {r['ep_step_ms']} | {r['ep_over_tp']} | "
           f"{r['tokens_equal']} |" for r in rows]
        + ["", "One routed-experts module alone (no collective), this rank's shard, the batch's tokens routed uniformly "
           "at random; median ms per forward:", "",
           "| model | batch | rank 0 TP | rank 0 EP | rank 1 TP | rank 1 EP |", "|---|---|---|---|---|---|"]
        + [f"| {r['model']} | {r['batch']} | " + " | ".join(f"{e['tp']} | {e['ep']}" for e in r["experts_ms_by_rank"])
           + " |" for r in rows])
    print(table)
    write_results(args.name, {"rows": rows, "rounds": args.rounds, "max_tokens": args.max_tokens}, table)
    return 0 if all(r["tokens_equal"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
