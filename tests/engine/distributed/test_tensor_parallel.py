"""tp=2 over gloo in two processes gives the same greedy tokens as one process (sharded attention
heads, sharded MLP, row-parallel all-reduce), for MHA, GQA and more ranks than KV heads; also with async
scheduling, where every rank launches step N+1 before reading step N (the collectives stay in order), and
with the collectives in shared memory (engine/distributed/shm_collectives.py) instead of gloo, and with
cpu_compile (under tp the matmuls run as packed GEMMs, each rank's shard its own, before the all-reduce)."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.distributed import shm_collectives

from tests.support.ranks import free_port

PROMPTS = [[5, 9, 22, 41, 8, 120, 7], [3, 4, 5], list(range(10, 40))]


def _generate(engine: LLMEngine, params: SamplingParams) -> list[list[int]]:
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [done[str(i)] for i in range(len(PROMPTS))]


def _rank_main(rank: int, world: int, port: int, cases: list, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    shm = shm_collectives.connect(dist.distributed_c10d._get_default_store(), "tp/", rank, world)
    try:
        for model_dir, params, ahead, in_shm, compile_mode in cases:
            cfg = EngineConfig(model=model_dir, num_kv_blocks=64, block_size=4, tp_size=world, tp_rank=rank,
                               async_scheduling=ahead, cpu_compile=compile_mode)
            calls = shm.calls if shm else 0
            engine = LLMEngine(cfg, tp_group=dist.group.WORLD, tp_shm=shm if in_shm else None)
            tokens = _generate(engine, params)
            assert not ahead or engine.num_overlapped_steps > 0
            assert in_shm == (shm is not None and shm.calls > calls)  # the shm path carried them, or was unused
            model = engine.runner.model
            if compile_mode != "off":  # no pieces under tp (they would hold the all-reduce): packed GEMMs
                assert model.piecewise is None and any(model.layers[0].mlp.down_proj.packed.kernels.values())
            queue.put((rank, model_dir, params.temperature, ahead, in_shm, compile_mode, tokens,
                       engine.kv_cache.shape[4]))
    finally:
        dist.destroy_process_group()


ARCHS = ["llama", "qwen3", "llama3"]  # llama3 has 1 KV head: replicated on both ranks
TEMPERATURES = [0.0, 0.9]


def test_tp2_matches_single_process(checkpoints):
    """One pair of processes runs every case (spawning is the slow part)."""
    cases = [(checkpoints[a][0], SamplingParams(max_tokens=16, temperature=t, seed=7, ignore_eos=True), False, False,
              "off") for a in ARCHS for t in TEMPERATURES]
    cases += [(m, params, True, False, "off") for m, params, _, _, _ in cases if m == checkpoints["llama"][0]]
    if shm_collectives.available():
        cases += [(m, params, ahead, True, "off") for m, params, ahead, _, _ in cases]
    cases += [(m, params, False, False, "layers") for m, params, ahead, in_shm, _ in cases
              if m == checkpoints["qwen3"][0] and not ahead and not in_shm]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, 2, port, cases, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    for _ in range(2 * len(cases)):
        rank, model_dir, temperature, ahead, in_shm, compile_mode, tokens, heads = queue.get(timeout=300)
        got[(rank, model_dir, temperature, ahead, in_shm, compile_mode)] = (tokens, heads)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for arch in ARCHS:
        model_dir, hf = checkpoints[arch]
        for (m, params, ahead, in_shm, compile_mode) in [c for c in cases if c[0] == model_dir]:
            single = _generate(LLMEngine(EngineConfig(model=model_dir, num_kv_blocks=64, block_size=4)), params)
            key = (m, params.temperature, ahead, in_shm, compile_mode)
            r0, r1 = got[(0, *key)], got[(1, *key)]
            assert r0[0] == r1[0] == single, (arch, params.temperature, ahead, in_shm, compile_mode)
            assert r0[1] == max(1, hf.config.num_key_value_heads // 2)
