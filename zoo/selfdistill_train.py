"""Trains MTP and EAGLE-3 heads for a real target on self-distilled data (zoo.selfdistill), resumably.

Made cheap enough for two CPU cores (the plain `tandem zoo train-draft` path ran ~160 tokens/s here):
- one target forward (bf16 autocast where the CPU has native bf16, else fp32) feeds BOTH heads: its last
  hidden state (MTP), three captured layers (EAGLE-3) and its argmax, the label (hard-label distillation: a
  greedy draft is accepted exactly when it equals the target's argmax; under a grammar, the argmax over what
  the grammar allows: a guided greedy record's emitted token, zoo/selfdistill_rows.py);
- `soft_weight` > 0 mixes in soft labels (knowledge distillation, as EAGLE trains): cross-entropy against the
  target's whole next-token distribution over the training vocabulary, recomputed from the cached final hidden
  state at the sampled positions only (the cache keeps no logits: 49k floats a token). A distribution says more
  per position than its argmax (which runner-up tokens are close), where the data is small; it is skipped where
  a grammar overrode the argmax (the unmasked distribution would teach a token verification rejects);
- the vocabulary projection, the cost that dominates on a 49k vocabulary, runs on a sample of at most
  `positions` positions per depth; MTP's softmax spans the whole vocabulary (its frozen LM head is the
  target's and drafts from all of it) or its token map (`mtp_token_map`, the ids it then drafts from),
  EAGLE-3's its draft vocabulary (the `draft_vocab_size` most frequent labels, with d2t as its authors publish);
- heads, optimizers, the data cursor and the RNG are checkpointed every `save_every` steps (atomic rename),
  and a stopped run resumes from the checkpoint with the same schedule.

Rows, batches and per-source oversampling (`source_weights`): zoo/selfdistill_rows.py.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.speculative.token_map import read_token_map
from zoo.distill import STEP_DECAY, shift_left
from zoo.features import target_features
from zoo.heads.eagle3 import Eagle3Head, default_aux_layer_ids, draft_vocab
from zoo.heads.mtp import MTPHead
from zoo.recipe import Schedule
from zoo.selfdistill_rows import batches, emitted_from, emitted_labels, parse_source_weights, read_rows
from zoo.training import autocast, bf16_is_fast, lr_at, make_optimizer, set_lr

log = logging.getLogger(__name__)
DATA_RECIPE = ("python -m zoo.selfdistill --model <smollm2 gguf> --gsm8k 600 --schemas 500 --batch 16 --max-tokens 320 "
               "--shard i/2 (two processes; greedy, 30% of unguided prompts sampled at temperature 0.7, half the "
               "schema prompts guided by their grammar)")
HEADS = ("mtp", "eagle3")  # the heads a trainer holds (TrainPlan.train names some of them)
_MTP_SHARED = ("embed_tokens.weight", "shared_head.norm.weight", "shared_head.head.weight")  # the target's, frozen


@dataclass(frozen=True)
class TrainPlan:
    steps: int = 3000
    batch_tokens: int = 4096  # tokens per step (rows x padded length)
    seq_len: int = 640
    depth: int = 3
    lr: float = 1.5e-3
    positions: int = 768  # vocabulary projections per depth per head per step
    prompt_weight: float = 0.2
    draft_vocab_size: int = 12288
    save_every: int = 25
    seed: int = 0
    mtp_token_map: str = ""  # the hot vocabulary MTP drafts from (engine/speculative/token_map.py); "": all ids
    source_weights: str = ""  # "source=w,...": records per epoch by source (zoo/selfdistill_rows.py)
    soft_weight: float = 0.0  # share of the loss on the target's distribution (module docstring); 0: hard labels
    # the heads this run trains; the others keep their --init weights (e.g. a deeper unroll for EAGLE-3 alone)
    train: str = "mtp,eagle3"
    # loss weight of unroll step d is step_decay**d: below 1 keeps the shallow depths (what chains run) ahead of the
    # deep ones a long unroll adds (session 40: an 8-step fine-tune at 0.8 lost 0.03 agreement at depths 2-3)
    step_decay: float = STEP_DECAY


@dataclass(frozen=True)
class SoftLabels:
    """What soft labels need at a step: the target's final (normed) hidden state [B, T, H], where its argmax is
    the label [B, T] (False where a grammar chose another token), and the loss share they take."""
    hidden: torch.Tensor
    valid: torch.Tensor
    weight: float


def sampled_head_loss(head, features: dict, top: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor,
                      depth: int, rows: torch.Tensor, label_index: torch.Tensor, positions: int,
                      generator: torch.Generator, soft: SoftLabels | None = None,
                      target_head: torch.Tensor | None = None,
                      step_decay: float = STEP_DECAY) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Loss of a `depth`-step unroll on sampled positions; -> (loss, [(agree, count)] per depth).

    top [B, T]: the target's argmax. rows [V']: the LM-head rows of the training vocabulary (target ids for
    MTP; EAGLE-3 uses its draft head whole). label_index [V]: target id -> index into those rows, -1 outside.
    soft / target_head [V', H]: soft labels (SoftLabels) and the target's LM-head rows of the training
    vocabulary, in the order of the head's logits, to project the target's hidden state with.
    """
    b, t = ids.shape
    pos = torch.arange(t).expand(b, t)
    hidden, cache, total, agree = head.first_hidden(features), [], 0.0, []
    for step in range(depth):
        hidden = head.step_hidden(hidden, shift_left(ids, 1 + step, 0), pos + step, cache)
        n = t - 2 - step
        if n <= 0:
            break
        label = label_index[top[:, 1 + step: 1 + step + n]]  # [B, n]: the target's next token after i+1+step
        w = weight[:, 2 + step:] * (label >= 0)
        keep = w.nonzero(as_tuple=True)
        if keep[0].numel() == 0:
            continue
        if keep[0].numel() > positions:
            pick = torch.randperm(keep[0].numel(), generator=generator)[:positions]
            keep = (keep[0][pick], keep[1][pick])
        out = hidden[:, :n][keep]
        if head.kind == "mtp":
            logits = F.linear(out, head.shared_head.head.weight[rows])  # `out` is already shared_head.norm'ed
        else:
            logits = head.logits_from(out)
        per_pos = F.cross_entropy(logits.float(), label[keep], reduction="none")
        if soft is not None and soft.weight > 0:
            at = (keep[0], keep[1] + 1 + step)  # the target's prediction that the label came from
            with torch.no_grad():
                p = F.softmax(F.linear(soft.hidden[at], target_head).float(), dim=-1)
            soft_ce = -(p * F.log_softmax(logits.float(), dim=-1)).sum(-1)
            share = soft.valid[at].float() * soft.weight
            per_pos = (1 - share) * per_pos + share * soft_ce
        wk = w[keep]
        total = total + step_decay**step * (per_pos * wk).sum() / wk.sum()
        agree.append((int((logits.argmax(-1) == label[keep]).sum()), int(keep[0].numel())))
    return total, agree


class HeadTrainer:
    """Both heads over one target; `run` trains until plan.steps, checkpointing into `ckpt_dir`."""

    def __init__(self, target_dir: Path, data: Path, ckpt_dir: Path, plan: TrainPlan, init: Path | None = None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.plan, self.ckpt_dir = plan, Path(ckpt_dir)
        self.trained = [name.strip() for name in plan.train.split(",") if name.strip()]
        if not self.trained or set(self.trained) - set(HEADS):  # before the target loads
            raise ValueError(f"train={plan.train!r}: name one or more of {list(HEADS)}")
        if not 0 < plan.step_decay <= 1:
            raise ValueError(f"step_decay={plan.step_decay}: pass a weight in (0, 1] (1 weighs every unroll step alike)")
        self.bf16 = bf16_is_fast("cpu")  # autocast only where bf16 matmuls are native (fp32 masters either way)
        self.target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
        for p in self.target.parameters():
            p.requires_grad_(False)
        tok = AutoTokenizer.from_pretrained(str(target_dir))
        self.pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        sources: list[str] = []
        self.emitted: list[int | None] = []  # rows whose response tokens are their labels (zoo/selfdistill_rows.py)
        self.rows = read_rows(data, plan.seq_len, plan.prompt_weight, sources, self.emitted)
        if not self.rows:
            raise ValueError(f"{data} holds no usable records")
        weights = parse_source_weights(plan.source_weights)
        unknown = sorted(set(weights) - set(sources))
        if unknown:
            raise ValueError(f"source_weights names {unknown}, which {data} does not hold (it holds {sorted(set(sources))})")
        self.repeats = [weights.get(s, 1.0) for s in sources] if weights else None
        if self.repeats is not None and not any(self.repeats):
            raise ValueError(f"source_weights {plan.source_weights!r} leaves no record of {data} to train on")
        vocab = self.target.config.vocab_size
        counts = Counter(t for ids, _ in self.rows for t in ids)
        token_counts = torch.tensor([counts.get(i, 0) for i in range(vocab)])
        # MTP's softmax runs over the WHOLE vocabulary: its LM head is the target's, frozen, and drafts from all
        # of it, so every id must learn to lose. (Over the data's ids only, held-aside depth-1 agreement was
        # 0.10 where the training batches showed 0.57: ids never seen as negatives won the argmax.)
        # With a token map (plan.mtp_token_map) the head drafts from the map's ids only (SpecConfig.token_map), so its
        # softmax spans exactly those: ~3x less of the costliest part of a step at SmolLM2's 16,384 of 49,152.
        self.mtp_rows = read_token_map(plan.mtp_token_map, vocab) if plan.mtp_token_map else torch.arange(vocab)
        self.mtp_index = torch.full((vocab,), -1, dtype=torch.long)
        self.mtp_index[self.mtp_rows] = torch.arange(len(self.mtp_rows))
        always = tuple(t for t in (tok.eos_token_id, tok.bos_token_id) if t is not None)
        d2t, t2d = draft_vocab(token_counts, min(plan.draft_vocab_size, vocab), always)
        self.aux_ids = default_aux_layer_ids(self.target.config.num_hidden_layers)
        g = torch.Generator().manual_seed(plan.seed)
        self.heads = {"mtp": MTPHead.from_target(self.target, g),
                      "eagle3": Eagle3Head.from_target(self.target, d2t, t2d, self.aux_ids, g)}
        schedule = self.schedule()
        self.optimizers = {k: make_optimizer(h, schedule) for k, h in self.heads.items()}
        self.step, self.rng, self.generator = 0, random.Random(plan.seed), torch.Generator().manual_seed(plan.seed)
        self.history: list[dict] = []
        self._cache: dict[int, dict] = {}
        (self.ckpt_dir / "features").mkdir(parents=True, exist_ok=True)
        if not self._resume():
            if init is not None:
                self._init_from(Path(init))
            elif set(self.trained) != set(self.heads):
                raise ValueError(f"train={plan.train!r} leaves heads untrained: pass --init to take them from")
        d2t = self.heads["eagle3"].d2t  # the checkpoint's draft vocabulary when resumed
        self.eagle_index = torch.full((vocab,), -1, dtype=torch.long)
        self.eagle_index[d2t + torch.arange(len(d2t))] = torch.arange(len(d2t))
        # the target's LM-head rows in each head's logits order: soft labels project the target's hidden state
        lm_head = self.target.get_output_embeddings().weight
        self.target_heads = ({"mtp": lm_head[self.mtp_rows], "eagle3": lm_head[d2t + torch.arange(len(d2t))]}
                             if plan.soft_weight else {"mtp": None, "eagle3": None})

    def schedule(self) -> Schedule:
        return Schedule(steps=self.plan.steps, batch_size=1, lr=self.plan.lr,
                        warmup_steps=max(1, self.plan.steps // 30))

    def _init_from(self, exported: Path) -> None:
        """Start from heads exported earlier (e.g. the prebuilt ones: a later session goes on training them;
        their optimizer state is not kept, so Adam starts afresh)."""
        from safetensors.torch import load_file

        for name, head in self.heads.items():
            state = load_file(str(exported / name / "model.safetensors"))
            if name == "mtp":
                prefix = f"model.layers.{head.layer_index}."
                state = {k[len(prefix):]: v for k, v in state.items()}
            own = head.state_dict()
            missing = [k for k in own if k not in state and not (name == "mtp" and k in _MTP_SHARED)]
            if missing:
                raise ValueError(f"{exported / name} lacks {missing[:3]}")
            own.update({k: v.to(own[k].dtype) for k, v in state.items()})
            head.load_state_dict(own)
        log.info("initialized both heads from %s", exported)

    def _resume(self) -> bool:
        path = self.ckpt_dir / "state.pt"
        if not path.is_file():
            return False
        state = torch.load(path, weights_only=False)
        if state["plan"] != asdict(self.plan):
            log.warning("checkpoint plan %s differs from %s; resuming with the new plan", state["plan"], asdict(self.plan))
        for k, head in self.heads.items():
            head.load_state_dict(state["heads"][k])
            self.optimizers[k].load_state_dict(state["optimizers"][k])
        self.step, self.history = state["step"], state["history"]
        self.rng.setstate(state["rng"])
        self.generator.set_state(state["generator"])
        log.info("resumed at step %d", self.step)
        return True

    def features(self, group: list[int], ids: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """The target's features for a batch of rows: from the feature cache when every row is in it, else
        one forward whose rows then join the cache. A row's features do not depend on its batch (causal
        attention, right padding), so each row is cached once, in bf16, in RAM and under ckpt_dir/features/
        (a restarted run reuses them), and later epochs skip the target forward, the larger half of a step."""
        cached = [self._cached(i) for i in group]
        if any(c is None for c in cached):
            with autocast("cpu", self.bf16):
                features = target_features(self.target, ids, self.aux_ids)
            top = features.pop("logits").argmax(-1)
            for k in ("last_hidden", "aux_hidden"):  # as the cache keeps them, so every epoch sees the same inputs
                features[k] = features[k].bfloat16().float()
            for r, i in enumerate(group):
                n = len(self.rows[i][0])
                row = {"top": top[r, :n].to(torch.int32), "last_hidden": features["last_hidden"][r, :n].bfloat16(),
                       "aux_hidden": features["aux_hidden"][r, :n].bfloat16()}
                self._cache[i] = row
                torch.save(row, self._cache_path(i))
            return features, top
        b, t = ids.shape
        top = torch.zeros(b, t, dtype=torch.long)
        features = {k: torch.zeros(b, t, cached[0][k].shape[-1]) for k in ("last_hidden", "aux_hidden")}
        for r, row in enumerate(cached):
            n = row["top"].shape[0]
            top[r, :n] = row["top"]
            for k in features:
                features[k][r, :n] = row[k].float()
        return features, top

    def _cache_path(self, i: int) -> Path:
        key = hashlib.sha256(json.dumps(self.rows[i][0]).encode()).hexdigest()[:24]
        return self.ckpt_dir / "features" / f"{key}.pt"

    def _cached(self, i: int) -> dict | None:
        if i not in self._cache:
            path = self._cache_path(i)
            if not path.is_file():
                return None
            self._cache[i] = torch.load(path)
        return self._cache[i]

    def save(self) -> None:
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        state = {"plan": asdict(self.plan), "step": self.step, "history": self.history,
                 "heads": {k: h.state_dict() for k, h in self.heads.items()},
                 "optimizers": {k: o.state_dict() for k, o in self.optimizers.items()},
                 "rng": self.rng.getstate(), "generator": self.generator.get_state()}
        tmp = self.ckpt_dir / "state.pt.tmp"
        torch.save(state, tmp)
        os.replace(tmp, self.ckpt_dir / "state.pt")

    def run(self, until: int | None = None) -> None:
        plan, schedule = self.plan, self.schedule()
        stream = batches(self.rows, plan.batch_tokens, self.pad, self.rng, self.repeats)
        # A resumed run draws a fresh permutation from the restored RNG (and rereads the data file, which
        # the generator may have grown since), rather than replaying the stopped run's order.
        last = plan.steps if until is None else min(until, plan.steps)
        while self.step < last:
            group, ids, weight = next(stream)
            start = time.perf_counter()
            features, argmax = self.features(group, ids)
            top = emitted_labels(argmax, ids, [self.emitted[i] for i in group], [len(self.rows[i][0]) for i in group])
            soft = SoftLabels(features["last_hidden"], top == argmax, plan.soft_weight) if plan.soft_weight else None
            record = {"step": self.step, "tokens": int((weight > 0).sum())}
            for name in self.trained:
                head = self.heads[name]
                head.train()
                rows, index = (self.mtp_rows, self.mtp_index) if name == "mtp" else (None, self.eagle_index)
                with autocast("cpu", self.bf16):
                    loss, agree = sampled_head_loss(head, features, top, ids, weight, plan.depth, rows, index,
                                                    plan.positions, self.generator, soft, self.target_heads[name],
                                                    plan.step_decay)
                loss.backward()
                torch.nn.utils.clip_grad_norm_([p for p in head.parameters() if p.requires_grad], 1.0)
                set_lr(self.optimizers[name], lr_at(self.step, schedule))
                self.optimizers[name].step()
                self.optimizers[name].zero_grad(set_to_none=True)
                record[name] = {"loss": round(loss.item(), 4), "agree": agree}
            record["seconds"] = round(time.perf_counter() - start, 2)
            self.history.append(record)
            self.step += 1
            if self.step % 5 == 0:
                log.info("step %d %s", self.step, {k: v for k, v in record.items() if k != "step"})
            if self.step % plan.save_every == 0 or self.step == last:
                self.save()

    @torch.no_grad()
    def agreement(self, heldout: Path, top: int = 1) -> dict:
        """Teacher-forced top-1 agreement of each head with the target at depths 1..plan.depth, over the
        response tokens of held-aside records (zoo.selfdistill --heldout): depth d at a position counts when
        the head's d-th chained draft equals the target's argmax there (on a guided greedy record, the token it
        emitted: the argmax under its grammar; the head's guess is not masked). -> {head: [depth 1.., ]} over every
        record, and under "by_source" the same per record source (open chat and math differ a lot). `top` > 1
        counts the target's token among the head's `top` best instead: a tree's ceiling at that width."""
        from zoo.distill import head_agreement

        # source -> head -> per depth [hits, count]; the overall figures are their sums
        totals: dict[str, dict[str, list[list[int]]]] = {}
        for line in Path(heldout).read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            ids = torch.tensor([(rec["prompt_ids"] + rec["output_ids"])[: self.plan.seq_len]])
            scored = torch.zeros_like(ids, dtype=torch.bool)
            scored[0, len(rec["prompt_ids"]):] = True
            features = target_features(self.target, ids, self.aux_ids)
            labels = emitted_labels(features["logits"].argmax(-1), ids, [emitted_from(rec)], [ids.shape[1]])
            per_head = totals.setdefault(rec.get("source", "unknown"),
                                         {n: [[0, 0] for _ in range(self.plan.depth)] for n in self.heads})
            for name, head in self.heads.items():
                head.eval()
                allowed = None
                if name == "mtp" and self.plan.mtp_token_map:  # it drafts from its map: agreement as it drafts
                    allowed = self.mtp_index >= 0
                for d, (hit, count) in enumerate(head_agreement(head, features, ids, torch.ones_like(scored),
                                                                self.plan.depth, scored, allowed, labels, top)):
                    per_head[name][d][0] += hit
                    per_head[name][d][1] += count

        def rates(per_depth: list[list[int]]) -> list[float]:
            return [round(h / max(c, 1), 3) for h, c in per_depth]

        out: dict = {name: rates([[sum(src[name][d][i] for src in totals.values()) for i in (0, 1)]
                                  for d in range(self.plan.depth)]) for name in self.heads}
        out["by_source"] = {source: {name: rates(per) for name, per in heads.items()}
                            for source, heads in sorted(totals.items())}
        if top > 1:  # recall among the head's `top` best, not agreement: said in the record
            out["top"] = top
        return out

    def export(self, out_dir: Path) -> dict:
        """bf16 heads in the published layouts: MTP without its frozen copies of the target's embedding,
        final norm and LM head (the engine takes the target's), EAGLE-3 with its draft vocabulary."""
        out = {}
        for name, head in self.heads.items():
            head.eval()
            path = Path(out_dir) / name
            head.save(path, dtype=torch.bfloat16)
            if name == "mtp":
                _drop_shared(path / "model.safetensors", head.layer_index)
            out[name] = str(path)
        return out


def _drop_shared(path: Path, layer: int) -> None:
    from safetensors.torch import load_file, save_file

    from zoo.heads.mtp import FROZEN

    state = load_file(str(path))
    prefix = f"model.layers.{layer}."
    save_file({k: v for k, v in state.items() if k[len(prefix):] not in FROZEN}, str(path), metadata={"format": "pt"})


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m zoo.selfdistill_train", description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, help="the target's HF directory (or .gguf file)")
    ap.add_argument("--data", required=True, help="self-distilled JSON lines (python -m zoo.selfdistill)")
    ap.add_argument("--ckpt", required=True, help="checkpoint directory (resumed when it holds one)")
    ap.add_argument("--export", help="write the bf16 heads into DIR/mtp and DIR/eagle3 after training")
    ap.add_argument("--until", type=int, help="stop after this step (the schedule still spans --steps)")
    ap.add_argument("--init", help="exported heads (DIR/mtp, DIR/eagle3) to start from when --ckpt holds none")
    ap.add_argument("--heldout", help="held-aside records (zoo.selfdistill --heldout): print agreement at depths 1..--depth")
    ap.add_argument("--heldout-top", type=int, default=1,
                    help="with --heldout: count the target's token among the head's N best (a tree N wide's ceiling)")
    ap.add_argument("--recipe", default=DATA_RECIPE, help="how --data was generated, for the manifest")
    for name, value in asdict(TrainPlan()).items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    target = args.target
    if target.endswith(".gguf"):
        from engine.models.gguf import gguf_model_dir

        target = str(gguf_model_dir(target))
    plan = TrainPlan(**{k: getattr(args, k) for k in asdict(TrainPlan())})
    trainer = HeadTrainer(Path(target), Path(args.data), Path(args.ckpt), plan, Path(args.init) if args.init else None)
    trainer.run(args.until)
    if args.heldout_top < 1:
        ap.error(f"--heldout-top {args.heldout_top}: pass 1 or more")
    agreement = trainer.agreement(Path(args.heldout), args.heldout_top) if args.heldout else None
    if agreement:
        print(json.dumps({"agreement": agreement}))
    if args.export:
        heads = trainer.export(Path(args.export))
        write_manifest(Path(args.export), trainer, Path(args.data), Path(target), agreement, args.recipe)
        print(json.dumps(heads))
    return 0


def write_manifest(out_dir: Path, trainer: HeadTrainer, data: Path, target: Path, agreement: dict | None,
                   recipe: str = DATA_RECIPE) -> None:
    """prebuilt.json beside the exported heads: every file's sha256, the command, the data recipe and how much
    training went into them (steps, tokens, wall time), and the held-aside agreement when measured."""
    import sys

    from zoo.prebuilt import sha256_file
    from zoo.selfdistill import done_keys

    files = {str(p.relative_to(out_dir)): sha256_file(p)
             for p in sorted(out_dir.rglob("*")) if p.is_file() and p.name != "prebuilt.json"}
    sources = Counter(json.loads(line)["source"] for line in data.read_text(encoding="utf-8").splitlines() if line.strip())
    source = target / "gguf_source.json"
    manifest = {
        "model": "smollm2-135m-instruct",
        "target": json.loads(source.read_text()) if source.is_file() else str(target),
        "command": "python -m zoo.selfdistill_train " + " ".join(sys.argv[1:]),
        "data": {"file": data.name, "records": len(done_keys(data)), "by_source": dict(sources),
                 "recipe": recipe},
        "plan": asdict(trainer.plan), "steps_done": trainer.step,
        "tokens_seen": sum(r["tokens"] for r in trainer.history),
        "train_seconds": round(sum(r["seconds"] for r in trainer.history)),
        "agreement_heldout": agreement, "files": files,
    }
    (out_dir / "prebuilt.json").write_text(json.dumps(manifest, indent=2) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
