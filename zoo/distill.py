"""Self-distillation of draft heads (MTP, EAGLE-3) and a standalone draft model from a frozen target.

The teacher is the target's own next-token distribution on the training text; the students read the
target's hidden states from the same forward pass (one target forward feeds every student).

Heads are unrolled `depth` steps in parallel over all positions (EAGLE-3's training-time test):
step 0 is teacher-forced on the target's hidden states; steps 1..depth-1 run on the head's OWN
output hidden states of the previous step, with the text's tokens as inputs, attending to the step-0
keys of the prefix and to their own chain (see zoo.heads.layers). Step s at index i predicts the
token at i+2+s, so its teacher is the target's distribution at index i+1+s. Step s weighs 0.8**s.
EAGLE-3 learns the target distribution renormalized over its draft vocabulary, at positions whose
target argmax is in that vocabulary (as the EAGLE-3 authors train); students named in `hard_labels`
learn the target's argmax instead (cross-entropy), which the tiny recipe uses for EAGLE-3.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from tqdm import tqdm

from zoo.features import target_features
from zoo.recipe import Schedule
from zoo.training import autocast, lr_at, make_optimizer, set_lr

STEP_DECAY = 0.8


def shift_left(x: torch.Tensor, n: int, fill) -> torch.Tensor:
    """x[:, i + n] at index i; `fill` past the end. x [B, T, ...]."""
    out = torch.full_like(x, fill)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


def unroll(head, features: dict, ids: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """Run `head` depth steps over every position; -> per-step logits [B, T, head vocab]."""
    b, t = ids.shape
    positions = torch.arange(t, device=ids.device).expand(b, t)
    hidden, cache, logits = head.first_hidden(features), [], []
    for step in range(depth):
        hidden, step_logits = head.step(hidden, shift_left(ids, 1 + step, 0), positions + step, cache)
        logits.append(step_logits)
    return logits


def soft_cross_entropy(logits: torch.Tensor, teacher: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    per_pos = -(teacher * F.log_softmax(logits.float(), dim=-1)).sum(-1)
    return (per_pos * weight).sum() / weight.sum().clamp_min(1e-6)


def head_loss(head, features: dict, probs: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor, depth: int,
              hard: bool = False) -> torch.Tensor:
    """Weighted cross-entropy of a `depth`-step unroll against the target: its whole distribution
    (soft), or with `hard` its argmax as the label (mapped into the draft vocabulary for EAGLE-3).

    Step s at index i predicts token i+2+s: its teacher is the target at index i+1+s and it counts
    the weight of token i+2+s. The head's vocabulary projection runs only where that weight is > 0.
    """
    b, t = ids.shape
    positions = torch.arange(t, device=ids.device).expand(b, t)
    target_top = probs.argmax(-1)  # [B, T]
    hidden, cache, total = head.first_hidden(features), [], 0.0
    for step in range(depth):
        hidden = head.step_hidden(hidden, shift_left(ids, 1 + step, 0), positions + step, cache)
        n = t - 2 - step
        if n <= 0:
            break
        w = weight[:, 2 + step:]  # [B, n]
        if head.kind == "eagle3":
            w = w * head.t2d[target_top[:, 1 + step: 1 + step + n]]
        keep = w > 0
        logits = head.logits_from(hidden[:, :n][keep])  # [K, head vocab]
        if hard:
            label = target_top[:, 1 + step: 1 + step + n][keep]
            if head.kind == "eagle3":  # draft ids are the vocabulary's ids in increasing order
                label = head.t2d[: label.max() + 1].cumsum(0)[label] - 1
            per_pos = F.cross_entropy(logits.float(), label, reduction="none")
        else:
            teacher = probs[:, 1 + step: 1 + step + n][keep]  # [K, V]
            if head.kind == "eagle3":
                teacher = teacher[:, torch.arange(head.d2t.numel(), device=ids.device) + head.d2t]
                teacher = teacher / teacher.sum(-1, keepdim=True).clamp_min(1e-12)
            per_pos = -(teacher * F.log_softmax(logits.float(), dim=-1)).sum(-1)
        total = total + STEP_DECAY**step * (per_pos * w[keep]).sum() / w.sum().clamp_min(1e-6)
    return total


def draft_model_loss(draft, probs: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    logits = draft(input_ids=ids, use_cache=False).logits
    return soft_cross_entropy(logits, probs, shift_left(weight, 1, 0.0))


def distill(target, students: dict[str, torch.nn.Module], ids: torch.Tensor, weight: torch.Tensor,
            schedule: Schedule, depth: int, aux_layer_ids: list[int] | None, device: str = "cpu",
            desc: str = "heads", hard_labels: tuple[str, ...] = (), bf16: bool = False,
            after_step=None) -> dict[str, list[float]]:
    """Train every student on rows ids/weight [steps * batch, T]; -> per-student step losses.

    students: name -> MTPHead | Eagle3Head | an HF causal LM sharing the target's tokenizer (or any head with
    their kind/first_hidden/step_hidden/logits_from, as zoo.heads.deepseek_mtp's). `after_step` runs after
    each step's optimizer steps.
    """
    if ids.shape[0] < schedule.steps * schedule.batch_size:
        raise ValueError(f"need {schedule.steps * schedule.batch_size} sequences, got {ids.shape[0]}")
    target.to(device).eval()
    for param in target.parameters():
        param.requires_grad_(False)
    optimizers = {}
    for name, student in students.items():
        student.to(device).train()
        optimizers[name] = make_optimizer(student, schedule)
    losses: dict[str, list[float]] = {name: [] for name in students}
    bar = tqdm(range(schedule.steps), desc=desc, unit="step", leave=False)
    for step in bar:
        rows = slice(step * schedule.batch_size, (step + 1) * schedule.batch_size)
        x, r = ids[rows].to(device), weight[rows].to(device)
        with autocast(device, bf16):
            features = target_features(target, x, aux_layer_ids)
        probs = torch.softmax(features["logits"], dim=-1)
        for name, student in students.items():
            with autocast(device, bf16):
                if getattr(student, "kind", None) in ("mtp", "eagle3"):
                    loss = head_loss(student, features, probs, x, r, depth, hard=name in hard_labels)
                else:
                    loss = draft_model_loss(student, probs, x, r)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for p in student.parameters() if p.requires_grad], 1.0)
            set_lr(optimizers[name], lr_at(step, schedule))
            optimizers[name].step()
            optimizers[name].zero_grad(set_to_none=True)
            losses[name].append(loss.item())
        if after_step is not None:
            after_step()
        bar.set_postfix({n: f"{v[-1]:.2f}" for n, v in losses.items()})
    for student in students.values():
        student.eval()
    return losses


@torch.no_grad()
def head_agreement(head, features: dict, ids: torch.Tensor, real: torch.Tensor, depth: int,
                   scored: torch.Tensor | None = None, allowed: torch.Tensor | None = None,
                   target_top: torch.Tensor | None = None, top: int = 1) -> list[tuple[int, int]]:
    """Teacher-forced top-1 agreement per depth: [(matches, count)] for depths 1..depth; with `top` > 1 a match is
    the target's token among the head's `top` best (the most a tree `top` wide can accept at that depth).

    Depth d at index i compares the head's step d-1 argmax (mapped to target ids) with the target's
    argmax at index i+d (its prediction for token i+d+1). `scored` [B, T] limits which target
    positions i+d count (e.g. the JSON instance, not the prompt). `allowed` [V] bool: the target ids the
    head drafts from (its token map), the argmax taken over those only, as the engine drafts. `target_top`
    [B, T]: the labels, when not the target's plain argmax (e.g. the argmax under a grammar).
    """
    if target_top is None:
        target_top = features["logits"].argmax(-1)
    results = []
    for step, logits in enumerate(unroll(head, features, ids, depth)):
        full = head.to_target_vocab(logits)
        if allowed is not None:
            full = full.masked_fill(~allowed, float("-inf"))
        guess = full.topk(top, dim=-1).indices  # [B, T, top]; top 1 is the argmax
        want = shift_left(target_top, 1 + step, -1)
        valid = shift_left(real, 1 + step, False)
        if scored is not None:
            valid = valid & shift_left(scored, 1 + step, False)
        results.append((int(((guess == want[..., None]).any(-1) & valid).sum()), int(valid.sum())))
    return results
