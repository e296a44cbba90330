"""Engine throughput against transformers' `generate` on the same checkpoint and prompts.

Greedy, ignore EOS, fixed prompts and lengths; batch 1 and batch 16 (transformers left-padded).
Reports generated tokens per second of both and their ratio, measured in the same run, and on CUDA
the batch-1 decode step's achieved weight bandwidth against the device's peak.

    python -m bench.engine [--device cpu|cuda] [--new-tokens 128] [--threads N] [--repeats N] [--packed]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from bench.common import device_name, write_results

# About 25M parameters: big enough that the comparison is not pure Python overhead.
BENCH_CONFIG = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=6,
                    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                    tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
# ~1B parameters for the GPU bandwidth figure.
GPU_CONFIG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                  num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=4096,
                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
PEAK_BANDWIDTH_GBS = {"H100": 3350.0, "H200": 4800.0, "A100": 2039.0}


def make_model(path: str, config: dict, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config)).to(dtype).eval()
    model.save_pretrained(path)
    return model


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (length + 7 * i % 23,), generator=g).tolist() for i in range(n)]


def run_tandem(llm, batch: list[list[int]], new_tokens: int) -> tuple[float, int]:
    from engine import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(batch, params)
    _sync(llm.engine.runner.device)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outs)


@torch.inference_mode()
def run_hf(model, batch: list[list[int]], new_tokens: int, device) -> tuple[float, int]:
    width = max(map(len, batch))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0)
    _sync(device)
    return time.perf_counter() - start, (out.shape[1] - width) * len(batch)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def host_memory_bandwidth_gbs(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Best-of-N read+write copy bandwidth of this machine's memory (the CPU roofline)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best / 1e9


def decode_bandwidth(llm, model_params_bytes: int, steps: int = 64) -> dict:
    """Batch-1 decode: steps per second x weight bytes, against the device's peak bandwidth."""
    from engine import SamplingParams

    llm.generate([[5] * 16], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    elapsed, n = run_tandem(llm, [[5] * 16], steps)
    step_s = elapsed / n
    achieved = model_params_bytes / step_s / 1e9
    name = torch.cuda.get_device_name(0)
    peak = next((v for k, v in PEAK_BANDWIDTH_GBS.items() if k in name), None)
    return {"step_ms": step_s * 1e3, "achieved_GBs": achieved, "peak_GBs": peak,
            "fraction_of_peak": achieved / peak if peak else None}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--name", default=None, help="results file name under bench/results/ (default engine_<device>)")
    ap.add_argument("--repeats", type=int, default=1, help="alternating runs of each engine; the fastest is kept")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads for both engines (0: torch's default, one per core)")
    ap.add_argument("--packed", action="store_true",
                    help="CPU: also run tandem with cpu_compile (--cpu-compile mode), alternating")
    ap.add_argument("--cpu-compile", default="gemm", choices=["gemm", "layers"])
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from engine import LLM

    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    rows, results = [], {"device": device_name(args.device), "load_before": os.getloadavg(), "config": BENCH_CONFIG, "dtype": str(dtype),
                         "new_tokens": args.new_tokens, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        hf = make_model(tmp, BENCH_CONFIG, dtype).to(args.device)
        n_params = sum(p.numel() for p in hf.parameters())
        llm = LLM(tmp, device=args.device, max_num_seqs=64, num_kv_blocks=2048, block_size=16)
        packed = (LLM(tmp, device=args.device, max_num_seqs=64, num_kv_blocks=2048, block_size=16,
                      cpu_compile=args.cpu_compile)
                  if args.packed and args.device == "cpu" else None)
        for bs in [int(b) for b in args.batches.split(",")]:
            batch = prompts(bs, args.prompt_len, BENCH_CONFIG["vocab_size"])
            run_tandem(llm, batch, 8)  # warm-up all
            run_hf(hf, batch, 8, args.device)
            if packed is not None:
                run_tandem(packed, batch, 8)
            t_best = h_best = p_best = 0.0
            for _ in range(args.repeats):  # alternate, keep each one's fastest run (a shared CPU)
                t_time, t_tok = run_tandem(llm, batch, args.new_tokens)
                h_time, h_tok = run_hf(hf, batch, args.new_tokens, args.device)
                t_best, h_best = max(t_best, t_tok / t_time), max(h_best, h_tok / h_time)
                if packed is not None:
                    p_time, p_tok = run_tandem(packed, batch, args.new_tokens)
                    p_best = max(p_best, p_tok / p_time)
            run = {"batch": bs, "tandem_tok_s": t_best, "transformers_tok_s": h_best, "speedup": t_best / h_best}
            row = f"| {bs} | {run['tandem_tok_s']:.1f} | {run['transformers_tok_s']:.1f} | {run['speedup']:.2f}x |"
            if packed is not None:
                run.update(packed_tok_s=p_best, packed_speedup=p_best / h_best)
                row += f" {p_best:.1f} | {p_best / h_best:.2f}x | {p_best / t_best:.2f}x |"
            results["runs"].append(run)
            rows.append(row)
            print(rows[-1], flush=True)
        results["params"] = n_params
        if args.device == "cpu":
            # Batch-1 decode reads every weight once per token: how close is that to the memory roofline?
            weight_bytes = n_params * 4
            t1 = next(r for r in results["runs"] if r["batch"] == 1)["tandem_tok_s"] if any(
                r["batch"] == 1 for r in results["runs"]) else None
            # The roofline is the machine's: copy with every core, and beside it with the engine's threads.
            threads = torch.get_num_threads()
            torch.set_num_threads(os.cpu_count())
            results["host_copy_GBs"] = host_memory_bandwidth_gbs()
            torch.set_num_threads(threads)
            results["threads"] = threads
            results["host_copy_GBs_engine_threads"] = host_memory_bandwidth_gbs()
            if t1:
                results["batch1_weight_GBs"] = weight_bytes * t1 / 1e9
            p1 = next((r.get("packed_tok_s") for r in results["runs"] if r["batch"] == 1), None)
            if p1:
                results["batch1_weight_GBs_packed"] = weight_bytes * p1 / 1e9
        del hf, llm, packed
        if args.device.startswith("cuda"):
            hf = make_model(tmp + "/1b", GPU_CONFIG, torch.bfloat16)
            weight_bytes = sum(p.numel() * p.element_size() for p in hf.parameters())
            del hf
            llm = LLM(tmp + "/1b", device=args.device, max_num_seqs=8, num_kv_blocks=256)
            results["decode_bandwidth_1b"] = decode_bandwidth(llm, weight_bytes)
    table = "\n".join([
        f"# bench/engine.py on {results['device']}",
        f"Random Llama, {n_params / 1e6:.1f}M parameters, {dtype}, greedy, {args.new_tokens} new tokens, "
        f"prompts ~{args.prompt_len} tokens, best of {args.repeats} alternating runs. Tokens/s = generated "
        f"tokens / wall time (prefill included). "
        f"Load average before {results['load_before'][0]:.2f}, after {os.getloadavg()[0]:.2f}.",
        "", "| batch | tandem tok/s | transformers tok/s | ratio |" + (
            " tandem packed tok/s | packed vs transformers | packed vs tandem |" if args.packed else ""),
        "|---|---|---|---|" + ("---|---|---|" if args.packed else ""), *rows])
    if "batch1_weight_GBs" in results:
        table += (f"\n\nBatch 1 reads all {n_params * 4 / 1e6:.0f} MB of fp32 weights per token: "
                  f"{results['batch1_weight_GBs']:.1f} GB/s achieved against {results['host_copy_GBs']:.1f} GB/s "
                  f"measured copy bandwidth of this machine (the roofline for batch-1 decode; "
                  f"{results['host_copy_GBs_engine_threads']:.1f} GB/s copying with the engine's "
                  f"{results['threads']} thread(s)).")
        if "batch1_weight_GBs_packed" in results:
            gbs = results["batch1_weight_GBs_packed"]
            table += (f" With `cpu_compile={args.cpu_compile}`: {gbs:.1f} GB/s, "
                      f"{gbs / results['host_copy_GBs']:.0%} of the copy bandwidth.")
    if "decode_bandwidth_1b" in results:
        bw = results["decode_bandwidth_1b"]
        table += (f"\n\nBatch-1 decode, 1B random Llama bf16: {bw['step_ms']:.2f} ms/step, "
                  f"{bw['achieved_GBs']:.0f} GB/s of {bw['peak_GBs']} GB/s peak")
    tag = "cuda" if args.device.startswith("cuda") else "cpu"
    print(write_results(args.name or f"engine_{tag}", results, table).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
