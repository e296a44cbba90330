"""The MoE families across two ranks over gloo give the same tokens as one process:
- tp=2: attention heads sharded (DeepSeek-V3: q_b/kv_b/o projections by heads, the latent cache replicated on
  both ranks), experts and shared experts sharded along their intermediate dim, one all-reduce per MoE layer;
- attention data parallelism (dp=2): each rank attends for its own requests over its own latent cache, the
  MoE and dense MLPs run sharded over both ranks' rows (DPContext's exchange), a rank without requests runs
  idle forwards;
greedy and seeded sampling, DeepSeek-V3 with and without its MTP layer drafting, Qwen3-MoE;
- expert parallelism (tp_ep, dp_ep): the routed experts sharded whole (4 of 8 per rank), composed with tp=2 and
  with attention data parallelism (DP attention + EP MoE, DeepSeek's serving layout).
One pair of processes runs every case (spawning is the slow part)."""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from engine.layers.moe import RoutedExperts
from tests.support.deepseek import add_mtp_layer, make_deepseek_checkpoint
from tests.support.qwen3_moe import make_qwen3_moe_checkpoint

from tests.support.ranks import free_port

pytestmark = pytest.mark.slow

PROMPTS = [[5, 9, 22, 41, 8, 120, 7], [3, 4, 5], list(range(10, 40))]
OWNER = [0, 1, 0]  # under dp=2, the rank each prompt runs on
PARAMS = {"greedy": SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
          "seeded": SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)}


def _config(model: str, mtp: bool, **kw) -> EngineConfig:
    return EngineConfig(model=model, num_kv_blocks=64, block_size=4,
                        speculative=SpecConfig(method="mtp", k=2) if mtp else None, **kw)


def _drive(engine: LLMEngine, reqs: list[tuple[int, SamplingParams]], group) -> dict[int, list[int]]:
    """Steps until no rank (group None: this engine alone) has work; prompt index -> tokens."""
    for i, params in reqs:
        engine.add_request(str(i), PROMPTS[i], params)
    done = {}
    while True:
        busy = torch.tensor([int(engine.has_unfinished())])
        if group is not None:
            dist.all_reduce(busy, group=group)
        if not busy.item():
            return done
        done.update({int(o.request_id): o.token_ids for o in engine.step() if o.finished})


def _cases(models: dict[str, str]) -> list[tuple[str, str, bool, str]]:
    """(mode, model key, mtp, params key); mode dp_padded: dp=2 with decode steps in the CUDA-graph layout (run
    eagerly here), padded to the group's agreed batch size, pad rows routed through the experts too."""
    cases = [(mode, "deepseek", mtp, p) for mode in ("tp", "dp") for mtp in (False, True) for p in PARAMS]
    cases += [("dp_padded", "deepseek", mtp, "greedy") for mtp in (False, True)]
    cases += [(mode, "deepseek", True, "greedy") for mode in ("tp_ep", "dp_ep")]
    return cases + [(mode, "qwen3_moe", False, "greedy") for mode in ("tp", "dp", "dp_ep")]


def _rank_main(rank: int, port: int, models: dict[str, str], queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        for mode, key, mtp, p in _cases(models):
            dp = 1 if mode.startswith("tp") else 2
            engine = LLMEngine(_config(models[key], mtp, tp_size=2, tp_rank=rank, attention_dp=dp,
                                       expert_parallel=mode.endswith("_ep")), tp_group=dist.group.WORLD)
            if mode.endswith("_ep"):  # the target's routed experts: this rank's half, whole
                experts = [m for m in engine.runner.model.modules() if isinstance(m, RoutedExperts)]
                assert experts and all(e.w13.shape[0] == 4 and e.first_expert == 4 * rank for e in experts)
            if mode == "dp_padded":
                engine.runner.use_graphs(8, capture=False, capture_on_demand=False)
            mine = [(i, PARAMS[p]) for i in range(len(PROMPTS)) if mode.startswith("tp") or OWNER[i] == rank]
            done = _drive(engine, mine, dist.group.WORLD)
            if mode == "dp_padded":
                assert engine.runner.graphs.num_runs > 0, "no step took the padded layout"
            queue.put((rank, (mode, key, mtp, p), done, tuple(engine.kv_cache.shape)))
    except BaseException as e:  # noqa: BLE001 - reported to the test, which would otherwise wait
        queue.put((rank, "error", repr(e), None))
        raise
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def models(tmp_path_factory, one_thread_module):
    root = tmp_path_factory.mktemp("moe_parallel")
    hf = make_deepseek_checkpoint(root / "deepseek", "q_lora", seed=21)
    add_mtp_layer(root / "deepseek", hf, seed=22)
    make_qwen3_moe_checkpoint(root / "qwen3_moe", "norm_topk", seed=23)
    return {"deepseek": str(root / "deepseek"), "qwen3_moe": str(root / "qwen3_moe")}


def test_two_ranks_equal_one_process(models):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, models, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(2 * len(_cases(models))):
            rank, case, done, shape = queue.get(timeout=600)
            assert case != "error", f"rank {rank} failed: {done}"
            got[(rank, case)] = (done, shape)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    for case in _cases(models):
        mode, key, mtp, p = case
        single = _drive(LLMEngine(_config(models[key], mtp)), [(i, PARAMS[p]) for i in range(len(PROMPTS))], None)
        (d0, s0), (d1, s1) = got[(0, case)], got[(1, case)]
        if mode.startswith("tp"):
            assert d0 == d1 == single, case
        else:  # each rank returns its own requests
            assert {**d0, **d1} == single and set(d0) == {0, 2} and set(d1) == {1}, case
        if key == "deepseek":  # the latent cache is whole on every rank: 1 row of kv_lora_rank + qk_rope per token
            assert s0 == s1 and s0[1] == 1 and s0[4] == 1 and s0[5] == 32 + 8, s0
