"""Build recipes: every number that decides what the zoo build produces.

A recipe plus its seed (and `threads`, the torch thread count it trains with, which changes float
summation order) determines the zoo's weights bit for bit on a given software stack. `micro` exists
for tests (seconds), `writer` is the default (trained once, about two hours on two CPU cores, and shipped
prebuilt under zoo/prebuilt/), `tiny` is its under-trained predecessor (6 minutes), `small` is larger.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int

    def __post_init__(self):
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"heads must divide hidden_size and kv heads must divide heads: {self}")


@dataclass(frozen=True, slots=True)
class MoeShape:
    """What makes a recipe's target DeepSeek-V3-shaped (zoo/moe.py): MLA attention and a MoE MLP. The target's
    ModelShape still gives the width, depth, heads and the dense layers' intermediate size."""

    q_lora_rank: int | None  # None: one q_proj (DeepSeek-V2-Lite), else q_a_proj -> q_a_layernorm -> q_b_proj
    kv_lora_rank: int  # the cached latent's width
    qk_nope_head_dim: int
    qk_rope_head_dim: int  # the decoupled rope key, cached beside the latent
    v_head_dim: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    first_k_dense_replace: int  # the first layers keep a dense MLP
    n_group: int  # group-limited routing: the experts in n_group groups, tokens routed within topk_group of them
    topk_group: int
    routed_scaling_factor: float
    bias_update_speed: float  # aux-loss-free balancing: e_score_correction_bias moves this much per step

    def __post_init__(self):
        if self.n_routed_experts % self.n_group or self.topk_group > self.n_group:
            raise ValueError(f"n_group must divide n_routed_experts and topk_group <= n_group: {self}")


@dataclass(frozen=True, slots=True)
class Schedule:
    steps: int
    batch_size: int  # sequences per step
    lr: float
    warmup_steps: int
    weight_decay: float = 0.1
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio


@dataclass(frozen=True, slots=True)
class Recipe:
    name: str
    vocab_size: int
    seq_len: int
    target: ModelShape
    target_schedule: Schedule
    draft_model: ModelShape  # the standalone two-model-speculation draft (same width as the target)
    heads_schedule: Schedule  # MTP, EAGLE-3 and the draft model distill together on one target pass
    ttt_depth: int  # draft steps unrolled in training (EAGLE-3's training-time test)
    draft_vocab_size: int  # EAGLE-3 lm_head rows
    stdlib_modules: int  # how many stdlib modules the corpus reads (code + docstrings)
    json_fraction: float = 0.8  # share of training sequences that start with JSON-Schema documents
    prompt_weight: float = 1.0  # loss weight of JSON prompt tokens (instances, code and text weigh 1)
    max_schema_chars: int | None = None  # train on schemas at most this long (compact JSON); eval uses all
    # Heads that learn the target's argmax (cross-entropy) instead of its whole distribution. EAGLE-3's
    # teacher renormalized over a half-size draft vocabulary trained it worse: on the tiny zoo,
    # held-out depth-1 agreement 0.58 soft vs 0.68 hard (MTP: 0.734 vs 0.737, so it stays soft).
    hard_labels: tuple[str, ...] = ()
    # Extra valid instances drawn per training schema by zoo.schema_gen (seeded by recipe seed and schema
    # name), on top of the curated ones: more distinct JSON to learn from than the curated ~3 per schema.
    generated_per_schema: int = 0
    # Train under CPU bfloat16 autocast (fp32 master weights): about 1.7x the tokens/s of fp32 on a
    # CPU with avx512_bf16, at the same shape.
    bf16_autocast: bool = False
    # Dtype the float tensors are stored in. bfloat16 halves the files (the prebuilt zoo must stay small);
    # configs still say float32, the dtype a CPU runs them in (bf16 values are exact in fp32).
    save_dtype: str = "float32"
    tokenizer_docs: int = 6000  # documents the tokenizer trains on
    max_docs_per_domain: int | None = None  # cap on training documents per domain (tests)
    # A DeepSeek-V3-shaped target (MLA + MoE) with its own MTP layer, built by zoo/moe.py; such a zoo has no
    # EAGLE-3 head and no draft model (draft_model and draft_vocab_size go unused).
    moe: MoeShape | None = None
    seed: int = 0
    threads: int = 2

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict) -> "Recipe":
        fields = dict(fields)
        for key in ("target", "draft_model"):
            fields[key] = ModelShape(**fields[key])
        for key in ("target_schedule", "heads_schedule"):
            fields[key] = Schedule(**fields[key])
        fields["hard_labels"] = tuple(fields.get("hard_labels", ()))
        if fields.get("moe") is not None:
            fields["moe"] = MoeShape(**fields["moe"])
        return cls(**fields)

    def with_seed(self, seed: int) -> "Recipe":
        return dataclasses.replace(self, seed=seed)


RECIPES: dict[str, Recipe] = {
    "micro": Recipe(
        name="micro", vocab_size=384, seq_len=64,
        target=ModelShape(32, 4, 4, 2, 64),
        target_schedule=Schedule(steps=6, batch_size=4, lr=3e-3, warmup_steps=2),
        draft_model=ModelShape(32, 1, 4, 2, 64),
        heads_schedule=Schedule(steps=4, batch_size=4, lr=3e-3, warmup_steps=1),
        ttt_depth=2, draft_vocab_size=128, stdlib_modules=4, tokenizer_docs=200,
        max_docs_per_domain=150, threads=1,
    ),
    # micro's MoE twin (tests, seconds): every stage of zoo/moe.py at the smallest shapes.
    "micro-moe": Recipe(
        name="micro-moe", vocab_size=384, seq_len=64,
        target=ModelShape(32, 2, 2, 2, 64),
        target_schedule=Schedule(steps=4, batch_size=4, lr=3e-3, warmup_steps=1),
        draft_model=ModelShape(32, 1, 2, 2, 64),
        heads_schedule=Schedule(steps=3, batch_size=4, lr=3e-3, warmup_steps=1),
        ttt_depth=2, draft_vocab_size=128, stdlib_modules=4, tokenizer_docs=200, max_docs_per_domain=150, threads=1,
        moe=MoeShape(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
                     n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
                     first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
                     bias_update_speed=1e-3),
    ),
    "tiny": Recipe(
        name="tiny", vocab_size=4096, seq_len=512,
        # Deep and narrow: a one-layer head costs about 1/8 of a target step, nearer the ratio of a
        # production model than a 4-layer target would give, for the same training time.
        target=ModelShape(192, 8, 6, 2, 512),
        target_schedule=Schedule(steps=260, batch_size=4, lr=3e-3, warmup_steps=15),
        draft_model=ModelShape(192, 1, 6, 2, 512),
        heads_schedule=Schedule(steps=104, batch_size=4, lr=2e-3, warmup_steps=8),
        ttt_depth=3, draft_vocab_size=2048, stdlib_modules=200, json_fraction=1.0, max_schema_chars=500,
        hard_labels=("eagle3",),
    ),
    # The default: the tiny shape trained ~90x longer on a JSON-heavy mix (generated instances of the
    # training schemas, GSM8K and docstrings as short plain text), so its greedy output is JSON for a
    # schema prompt. Measured: ~3.4k target tokens/s at batch 8 x 512 under bf16 autocast on 2 cores
    # beside another job, 2.4 s per head step: 14.7M target tokens and 3.7M head tokens took 1 h 53 min.
    # Its predecessor (1600 target and 360 head steps, 24 generated instances per schema, 34 min) left
    # the heads at 0.47-0.58 held-out agreement and the target looping on 38% of schema prompts.
    # Trained once and committed as zoo/prebuilt/writer (zoo.prebuilt).
    "writer": Recipe(
        name="writer", vocab_size=4096, seq_len=512,
        target=ModelShape(192, 8, 6, 2, 512),
        target_schedule=Schedule(steps=3600, batch_size=8, lr=2.5e-3, warmup_steps=80),
        draft_model=ModelShape(192, 1, 6, 2, 512),
        heads_schedule=Schedule(steps=900, batch_size=8, lr=2e-3, warmup_steps=40),
        ttt_depth=3, draft_vocab_size=2048, stdlib_modules=120, json_fraction=0.85, prompt_weight=0.5,
        max_schema_chars=1500, hard_labels=("eagle3",), generated_per_schema=32, bf16_autocast=True,
        save_dtype="bfloat16",
    ),
    # DeepSeek-V3 in miniature (issue 38): MLA (q_lora, a 32-wide latent + 16-wide rope key), a dense first layer,
    # then MoE layers of 8 routed experts (top 2 within 2 of 4 groups) + 1 shared, and its MTP layer (a MLA + MoE
    # block) distilled two steps deep. In fp32: CPU bf16 autocast ran the per-expert loop of transformers' MoE
    # slower, not faster. 1.47M target tokens and 0.4M MTP tokens took 946 s on two cores shared with other jobs
    # (load average 20-40; 240 target steps left it looping); committed prebuilt as zoo/prebuilt/tiny-moe.
    "tiny-moe": Recipe(
        name="tiny-moe", vocab_size=2048, seq_len=256,
        target=ModelShape(128, 3, 4, 4, 384),
        target_schedule=Schedule(steps=720, batch_size=8, lr=3e-3, warmup_steps=30),
        draft_model=ModelShape(128, 1, 4, 4, 384),
        heads_schedule=Schedule(steps=200, batch_size=8, lr=2e-3, warmup_steps=10),
        ttt_depth=2, draft_vocab_size=2048, stdlib_modules=40, json_fraction=0.85, prompt_weight=0.5,
        max_schema_chars=600, generated_per_schema=8, tokenizer_docs=3000, save_dtype="bfloat16",
        moe=MoeShape(q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                     n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=128,
                     first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                     bias_update_speed=1e-3),
    ),
    "small": Recipe(
        name="small", vocab_size=8192, seq_len=512,
        target=ModelShape(384, 12, 6, 2, 1024),
        target_schedule=Schedule(steps=600, batch_size=32, lr=2e-3, warmup_steps=30),
        draft_model=ModelShape(384, 2, 6, 2, 1024),
        heads_schedule=Schedule(steps=300, batch_size=16, lr=1.5e-3, warmup_steps=15),
        ttt_depth=4, draft_vocab_size=4096, stdlib_modules=400,
    ),
}


def get_recipe(size: str) -> Recipe:
    try:
        return RECIPES[size]
    except KeyError:
        raise ValueError(f"unknown zoo size {size!r}; choose one of {sorted(RECIPES)}") from None
