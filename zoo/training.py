"""Training the target (and the standalone draft model's shape): HF Llama built from a recipe shape,
AdamW with warmup and cosine decay, next-token loss on packed sequences. CPU-first, deterministic for
a fixed seed and thread count."""
from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Callable

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from zoo.recipe import ModelShape, Schedule

ROPE_THETA = 10000.0
MAX_POSITIONS = 2048


def llama_config(shape: ModelShape, vocab_size: int, special_ids: dict[str, int]) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.hidden_size // shape.num_heads,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_theta=ROPE_THETA,
        tie_word_embeddings=True,
        bos_token_id=special_ids["bos"],
        eos_token_id=special_ids["eos"],
        pad_token_id=special_ids["pad"],
        initializer_range=0.02,
        attn_implementation="sdpa",
    )


def new_llama(shape: ModelShape, vocab_size: int, special_ids: dict[str, int], seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(shape, vocab_size, special_ids)).float()


def lr_at(step: int, schedule: Schedule) -> float:
    if step < schedule.warmup_steps:
        return schedule.lr * (step + 1) / schedule.warmup_steps
    progress = (step - schedule.warmup_steps) / max(1, schedule.steps - schedule.warmup_steps)
    floor = schedule.min_lr_ratio
    return schedule.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(module: torch.nn.Module, schedule: Schedule) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not norms), as is usual for Llama training."""
    params = [p for p in module.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": schedule.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=schedule.lr, betas=(0.9, 0.95), eps=1e-8)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def weighted_lm_loss(logits: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy; token t's loss (predicted at t-1) counts weight[t]."""
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none")
    w = weight[:, 1:].flatten()
    return (nll * w).sum() / w.sum().clamp_min(1e-6)


def bf16_is_fast(device: str = "cpu") -> bool:
    """Whether bfloat16 matmuls beat fp32 here: GPUs, and CPUs with avx512_bf16 or AMX. On an AVX2-only CPU
    torch emulates them: a [2048, 576] x [576, 1536] matmul ran 7x slower in bf16 than in fp32 (10 vs 69
    GFLOP/s on a 2-core EPYC VM), so autocast there would cost, not save."""
    if torch.device(device).type != "cpu":
        return True
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def autocast(device: str, enabled: bool):
    """bfloat16 autocast for the forward passes when `enabled` (weights and optimizer stay fp32)."""
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16) if enabled else nullcontext()


def train_lm(model: LlamaForCausalLM, ids: torch.Tensor, weight: torch.Tensor, schedule: Schedule,
             desc: str = "target", device: str = "cpu", bf16: bool = False,
             after_step: Callable[[], None] | None = None) -> list[float]:
    """Next-token training on packed rows ids/weight [steps * batch, seq_len]; -> the step losses.
    `after_step` runs after each optimizer step (a MoE target's routing-bias update, zoo/moe.py)."""
    if ids.shape[0] < schedule.steps * schedule.batch_size:
        raise ValueError(f"need {schedule.steps * schedule.batch_size} sequences, got {ids.shape[0]}")
    model.to(device).train()
    optimizer = make_optimizer(model, schedule)
    losses = []
    bar = tqdm(range(schedule.steps), desc=desc, unit="step", leave=False)
    for step in bar:
        rows = slice(step * schedule.batch_size, (step + 1) * schedule.batch_size)
        x = ids[rows].to(device)
        with autocast(device, bf16):
            logits = model(input_ids=x, use_cache=False).logits
        loss = weighted_lm_loss(logits, x, weight[rows].to(device))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        set_lr(optimizer, lr_at(step, schedule))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    model.eval()
    return losses
