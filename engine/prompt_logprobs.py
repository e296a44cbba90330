"""Prompt logprobs (vLLM's `prompt_logprobs`; what OpenAI's completions return for an `echo`ed prompt with
`logprobs`): each prompt token's log-probability given the tokens before it, and the top n at its position.
The first token has none (nothing predicts it).

A pass of its own, run once per request right after the step that sampled its first token: the target's
forward over the prompt again, reading the KV that its prefill wrote (slot mapping -1: it writes nothing, so
the request's own decode is unchanged), in chunks of at most `max_rows` query rows. It costs a second
forward of the prompt for the requests that ask (scoring a prompt is what they are for), and in exchange
the step (model_step, its CUDA graphs, its one host read-back) stays as it is for every other request.
Logprobs are the raw model's (no temperature, no logit_bias), as the sampled tokens' are.
"""
from __future__ import annotations

import torch

from engine.layers.attention import AttentionMetadata, attention_context
from engine.models.llama import LlamaForCausalLM
from engine.outputs import TokenLogprob

LOGIT_ROWS = 256  # logits rows materialized at once ([rows, V] fp32: 48 MiB at a 49k vocabulary)


@torch.inference_mode()
def prompt_logprobs(model: LlamaForCausalLM, kv_cache: torch.Tensor, block_table: list[int], block_size: int,
                    token_ids: list[int], top_n: int, max_rows: int) -> list[TokenLogprob | None]:
    """kv_cache: [layers, 2, blocks, block_size, kv heads, head dim] holding the prompt's KV at `block_table`;
    token_ids: the prompt; top_n: also the n most likely tokens at each position (0: none).
    -> one entry per prompt token, None for the first."""
    n = len(token_ids)
    assert n and len(block_table) * block_size >= n, "the prompt's KV must be in the cache"
    device = kv_cache.device
    ids = torch.tensor(token_ids, dtype=torch.int64, device=device)  # [n]
    table = torch.tensor([block_table], dtype=torch.int32, device=device)  # [1, blocks]
    out: list[TokenLogprob | None] = [None]
    for start in range(0, n - 1, max_rows):  # row i predicts token i + 1; the last row predicts no prompt token
        end = min(start + max_rows, n - 1)
        rows = end - start
        attn = AttentionMetadata(
            kv_cache=kv_cache, slot_mapping=torch.full((rows,), -1, dtype=torch.int64, device=device),
            block_tables=table, seq_lens=torch.tensor([end], dtype=torch.int32, device=device),
            query_start_loc=torch.tensor([0, rows], dtype=torch.int32, device=device), max_q_len=rows,
            max_seq_len=end)
        positions = torch.arange(start, end, dtype=torch.int64, device=device)  # [rows]
        with attention_context(attn):
            final, _ = model(ids[start:end], positions)  # [rows, H]
        for lo in range(0, rows, LOGIT_ROWS):
            hi = min(lo + LOGIT_ROWS, rows)
            logprobs = model.compute_logits(final[lo:hi]).log_softmax(-1)  # [hi - lo, V] fp32
            nxt = ids[start + lo + 1: start + hi + 1]  # [hi - lo] the tokens these rows predict
            chosen = logprobs.gather(1, nxt[:, None])[:, 0].tolist()
            tops = logprobs.topk(top_n, dim=-1) if top_n else None
            top_ids = tops.indices.tolist() if tops is not None else None
            top_lps = tops.values.tolist() if tops is not None else None
            for j, token in enumerate(nxt.tolist()):
                top = dict(zip(top_ids[j], top_lps[j])) if tops is not None else None
                out.append(TokenLogprob(token, chosen[j], top))
    return out
