"""engine/masking/masker.py in the step: a masker constrains the first token after the prefill, every
verification row and every draft step, with and without speculation.

The masker here is a reference kept in this file: each constrained request may only emit tokens of
its own allowed set. References: transformers greedy decoding with the same constraint as a logits
processor (no speculation), and the masked engine without speculation (with speculation).
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.masking.masker import LogitsMasker, MaskRow
from tests.support.spec import random_prompts, spec_config


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread_module):
    """Tiny models: one intra-op thread (tests/engine/conftest.py)."""


class AllowedTokensMasker(LogitsMasker):
    """Request id -> the token ids it may emit; requests not named are unconstrained. Records what the
    step asked of it, so tests can see which rows were masked."""

    def __init__(self, allowed: dict[str, set[int]], vocab_size: int):
        self.allowed = allowed
        self.words = -(-vocab_size // 32)
        self.rows: tuple[MaskRow, ...] = ()
        self.verified_drafts: list[tuple[str, tuple[int, ...]]] = []  # (request, drafts it verified)
        self.draft_fills = 0  # draft steps with a constrained row
        self.accepted: dict[str, list[int]] = {}

    def _packed(self, ids: set[int]) -> torch.Tensor:
        bits = torch.zeros(self.words * 32, dtype=torch.int64)
        bits[list(ids)] = 1
        packed = (bits.view(-1, 32) << torch.arange(32)).sum(1)
        return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)

    def begin_step(self, rows):
        self.rows = rows
        constrained = [r for r in rows if r.request_id in self.allowed and r.samples]
        self.verified_drafts += [(r.request_id, r.drafts) for r in constrained]
        return bool(constrained)

    def fill_verify(self, bitmask, flags):
        for b, row in enumerate(self.rows):
            if row.request_id in self.allowed and row.samples:
                bitmask[b, : len(row.drafts) + 1] = self._packed(self.allowed[row.request_id])
                flags[b, : len(row.drafts) + 1] = True

    def fill_draft(self, step, emitted, num_accepted, drafts, bitmask, flags, forced):
        for b, row in enumerate(self.rows):
            if row.request_id in self.allowed and row.samples:
                bitmask[b] = self._packed(self.allowed[row.request_id])
                flags[b] = True
                self.draft_fills += 1

    def end_step(self):
        self.rows = ()

    def accept(self, request_id, token_ids):
        self.accepted.setdefault(request_id, []).extend(token_ids)


def _allowed(seed: int, vocab: int = 384, n: int = 40) -> set[int]:
    g = torch.Generator().manual_seed(seed)
    return set(torch.randperm(vocab, generator=g)[:n].tolist())


def _params(i: int, max_tokens: int = 16) -> SamplingParams:
    if i % 3 == 2:
        return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_k=50, seed=100 + i, ignore_eos=True)
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def _hf_masked_greedy(hf_dir: str, prompt: list[int], allowed: set[int], max_tokens: int) -> list[int]:
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    class OnlyAllowed(LogitsProcessor):
        def __call__(self, input_ids, scores):
            banned = torch.ones(scores.shape[-1], dtype=torch.bool)
            banned[list(allowed)] = False
            return scores.masked_fill(banned, float("-inf"))

    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                         logits_processor=LogitsProcessorList([OnlyAllowed()]), pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_masked_greedy_equals_transformers_with_the_same_constraint(llama_dir):
    """No speculation (k = 0): the first token after the prefill and every later one obey the mask,
    and the tokens are transformers' under the same constraint; an unconstrained neighbour in the
    batch is untouched."""
    prompts = random_prompts(3, seed=4)
    allowed = {"gen-0": _allowed(0), "gen-2": _allowed(2)}
    masker = AllowedTokensMasker(allowed, 384)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = LLM(llama_dir, num_kv_blocks=256, block_size=4, logits_masker=masker).generate(prompts, greedy)
    free = LLM(llama_dir, num_kv_blocks=256, block_size=4).generate(prompts[1], greedy)[0]
    assert outs[1].token_ids == free.token_ids
    for i in (0, 2):
        assert outs[i].token_ids == _hf_masked_greedy(llama_dir, prompts[i], allowed[f"gen-{i}"], 12)
        assert masker.accepted[f"gen-{i}"] == outs[i].token_ids


@pytest.mark.parametrize("method", ["self_draft", "eagle3", "mtp", "ngram"])
def test_masks_constrain_verification_and_draft_rows(llama_dir, spec_drafts, method):
    """With k = 3: greedy outputs equal the masked engine without speculation (masks on the k+1
    verification rows), sampled ones stay inside the allowed set, and the draft network's own steps
    are masked: every draft a constrained request verifies is allowed (through d2t for EAGLE-3's
    smaller draft vocabulary). The target as its own draft accepts every draft, as unmasked."""
    n = 6
    prompts = random_prompts(n, seed=9)
    allowed = {f"gen-{i}": _allowed(10 + i) for i in range(n) if i != 1}
    params = [_params(i) for i in range(n)]
    plain = LLM(llama_dir, num_kv_blocks=512, block_size=4, logits_masker=AllowedTokensMasker(allowed, 384))
    ref = plain.generate(prompts, params)
    masker = AllowedTokensMasker(allowed, 384)
    llm = LLM(llama_dir, num_kv_blocks=512, block_size=4, logits_masker=masker,
              speculative=spec_config(method, 3, spec_drafts, llama_dir))
    outs = llm.generate(prompts, params)
    for i, (o, r) in enumerate(zip(outs, ref)):
        if f"gen-{i}" in allowed:
            assert set(o.token_ids) <= allowed[f"gen-{i}"]
        if params[i].temperature == 0:
            assert o.token_ids == r.token_ids
    verified = [(rid, d) for rid, d in masker.verified_drafts if d]
    if method != "ngram":  # prompt lookup drafts are copied from the prompt, never masked
        assert verified and all(set(d) <= allowed[rid] for rid, d in verified)
        assert masker.draft_fills > 0
    if method == "eagle3":
        assert llm.engine.runner.proposer.d2t is not None  # the draft vocabulary is smaller: mapped masks
    if method == "self_draft":
        greedy = [o for i, o in enumerate(outs) if params[i].temperature == 0 and f"gen-{i}" in allowed]
        lengths = [a for o in greedy for a in o.metrics.accepted_lengths[:-1]]  # the last step may be cut short
        assert lengths and all(a == 4 for a in lengths)
    assert llm.engine.stats()["kv_blocks_used"] == 0


def test_draft_masks_switch(llama_dir):
    """SpecConfig(draft_masks=False) masks verification rows only: the self-draft's unmasked drafts
    are then rejected wherever the constraint bans them, and the tokens stay the same."""
    from engine import SpecConfig

    prompts, n = random_prompts(3, seed=2), 3
    allowed = {f"gen-{i}": _allowed(30 + i) for i in range(n)}
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    runs = {}
    for on in (True, False):
        masker = AllowedTokensMasker(allowed, 384)
        spec = SpecConfig(method="draft_model", k=3, draft=llama_dir, draft_masks=on)
        runs[on] = (LLM(llama_dir, num_kv_blocks=256, block_size=4, logits_masker=masker,
                        speculative=spec).generate(prompts, params), masker)
    assert [o.token_ids for o in runs[True][0]] == [o.token_ids for o in runs[False][0]]
    assert runs[False][1].draft_fills == 0 and runs[True][1].draft_fills > 0
    mean = {on: sum(sum(o.metrics.accepted_lengths) for o in outs) / sum(len(o.metrics.accepted_lengths) for o in outs)
            for on, (outs, _) in runs.items()}
    assert mean[True] > mean[False]


def test_unconstrained_steps_skip_masking(llama_dir):
    """A masker that constrains nothing this step makes the step run without bitmasks."""
    masker = AllowedTokensMasker({}, 384)
    llm = LLM(llama_dir, num_kv_blocks=64, block_size=4, logits_masker=masker)
    out = llm.generate(random_prompts(1)[0], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    free = LLM(llama_dir, num_kv_blocks=64, block_size=4).generate(random_prompts(1)[0],
                                                                  SamplingParams(max_tokens=4, temperature=0,
                                                                                 ignore_eos=True))[0]
    assert out.token_ids == free.token_ids and masker.draft_fills == 0
