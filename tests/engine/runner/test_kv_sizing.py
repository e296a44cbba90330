"""engine/runner/model_runner.py's KV sizing when EngineConfig.num_kv_blocks is left out: the memory budget's
blocks, never more than max_num_seqs requests of max_model_len hold."""
from engine import EngineConfig, LLMEngine


def test_blocks_default_to_what_max_num_seqs_requests_hold(llama_dir):
    engine = LLMEngine(EngineConfig(model=llama_dir, block_size=16, max_num_seqs=3, max_model_len=40))
    assert engine.stats()["kv_blocks_total"] == 3 * 3  # ceil(40 / 16) blocks for each of 3 requests


def test_blocks_stay_within_the_memory_budget(llama_dir):
    probe = LLMEngine(EngineConfig(model=llama_dir, block_size=16, num_kv_blocks=1))
    per_block = probe.runner.kv_block_bytes()
    engine = LLMEngine(EngineConfig(model=llama_dir, block_size=16, max_num_seqs=64, max_model_len=512,
                                    kv_cache_memory_gb=5.5 * per_block / 2**30))
    assert engine.stats()["kv_blocks_total"] == 5
    assert engine.kv_cache.numel() * engine.kv_cache.element_size() <= 5.5 * per_block
