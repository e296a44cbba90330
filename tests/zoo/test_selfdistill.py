"""zoo/selfdistill.py and zoo/selfdistill_train.py on the tiny zoo target: the prompt sets (training and
held-aside never overlap), generation that resumes, and the two-head trainer that checkpoints, resumes
exactly, and exports heads the engine drafts with losslessly."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from zoo.selfdistill import (QUERY_SENTINEL, Prompt, chat_ids, done_keys, generate, heldout_set, open_target,
                             prompt_set, query_prefix, query_prompts, schema_prompt, synthesize_queries,
                             usable_query)
from zoo.selfdistill_rows import batches, emitted_from, emitted_labels, epoch_rows, parse_source_weights, read_rows
from zoo.selfdistill_train import HeadTrainer, TrainPlan

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


@pytest.fixture(scope="module")
def data_dir() -> Path:
    if not (DATA / "prompts").is_dir():
        pytest.skip(f"the public evaluation data is not at {DATA}")
    return DATA


def test_training_and_heldout_prompts_never_overlap(data_dir):
    train = prompt_set(data_dir, gsm8k=50, schemas=40, seed=3)
    assert [p.key for p in train] == [p.key for p in prompt_set(data_dir, gsm8k=50, schemas=40, seed=3)]
    held = heldout_set(data_dir, 4)
    assert not {p.key for p in train} & {p.key for p in held}
    assert {p.source for p in train} == {"gsm8k", "vicuna", "humaneval", "jsonschemabench"}
    assert {p.source for p in held} == {"mt-bench", "gsm8k-test", "humaneval-heldout", "json-mode-eval"}
    guided = [p for p in train if p.guided]
    assert guided and all(p.schema is not None and p.temperature == 0.0 for p in guided)


def test_the_query_prefix_is_the_template_up_to_the_users_message(zoo_dir):
    import zoo

    llm = open_target(str(zoo.layout(zoo_dir).target), batch=4)
    tok = llm.tokenizer
    prefix = query_prefix(tok)
    text = tok.apply_chat_template([{"role": "user", "content": "How do tides work?"}], tokenize=False)
    assert text.startswith(prefix) and text[len(prefix):].startswith("How do tides work?")
    assert QUERY_SENTINEL not in prefix


def test_unusable_queries_are_dropped():
    assert usable_query("  How do I sort a list in Python?  ", "stop") == "How do I sort a list in Python?"
    assert usable_query("How do I sort a list in Python?", "length") is None  # cut at max_tokens
    assert usable_query("Hi?", "stop") is None
    assert usable_query("Tell me a joke<|im_start|>assistant", "stop") is None


def test_synthesized_queries_resume_from_their_cache(zoo_dir, tmp_path):
    """The target writes chat queries from its template's user-turn opening; a second call with the same
    cache generates nothing new and returns the same queries; the prompts they make are stable."""
    import zoo

    llm = open_target(str(zoo.layout(zoo_dir).target), batch=8)
    path = tmp_path / "queries.jsonl"
    calls = []
    real = llm.generate
    llm.generate = lambda *a, **k: calls.append(1) or real(*a, **k)
    first = synthesize_queries(llm, path, 2, seed=1, max_tokens=160, temperature=1.0, top_p=1.0, max_attempts=64)
    made = len(calls)
    assert len(first) == 2 and len({q.lower() for q in first}) == 2 and made >= 1
    attempts = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted(a["attempt"] for a in attempts) == list(range(len(attempts)))
    assert synthesize_queries(llm, path, 2, seed=1, max_tokens=160) == first and len(calls) == made
    prompts = query_prompts(first, seed=1)
    assert [p.key for p in prompts] == [p.key for p in query_prompts(first, seed=1)]
    assert all(p.source == "chat" and p.messages[0]["content"] in first for p in prompts)
    assert chat_ids(llm.tokenizer, prompts[0].messages)  # they render as chat prompts


@pytest.fixture(scope="module")
def records(zoo_dir, tmp_path_factory) -> Path:
    import zoo

    target = str(zoo.layout(zoo_dir).target)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    prompts = [Prompt("t-0", "test", ({"role": "user", "content": "Say hello."},)),
               Prompt("t-1", "test", schema_prompt(schema), schema, guided=True),
               Prompt("t-2", "test", ({"role": "user", "content": "Count to five."},), temperature=0.7)]
    out = tmp_path_factory.mktemp("selfdistill") / "data.jsonl"
    assert generate(target, prompts[:2], out, max_tokens=24, batch=2) == 2
    assert generate(target, prompts, out, max_tokens=24, batch=2) == 1  # resumes: only t-2 is new
    assert done_keys(out) == {"t-0", "t-1", "t-2"}
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    guided = next(r for r in rows if r["key"] == "t-1")
    assert guided["guided"]
    return out


def test_the_trainer_resumes_exactly_where_it_stopped(zoo_dir, records, tmp_path):
    import zoo

    target = zoo.layout(zoo_dir).target
    plan = TrainPlan(steps=4, batch_tokens=256, seq_len=128, positions=64, draft_vocab_size=512, save_every=2)
    straight = HeadTrainer(target, records, tmp_path / "a", plan)
    straight.run()
    first = HeadTrainer(target, records, tmp_path / "b", plan)
    first.run(until=2)
    resumed = HeadTrainer(target, records, tmp_path / "b", plan)
    assert resumed.step == 2 and resumed.history == first.history
    for name in ("mtp", "eagle3"):
        for (key, a), b in zip(first.heads[name].state_dict().items(), resumed.heads[name].state_dict().values()):
            assert torch.equal(a, b), key
    resumed.run()
    assert resumed.step == 4 and len(resumed.history) == 4
    losses = [r["mtp"]["loss"] for r in straight.history]
    assert all(l == l and l > 0 for l in losses)  # finite, positive


def test_mtp_trains_over_its_token_map(zoo_dir, records, tmp_path):
    """plan.mtp_token_map: MTP's softmax spans the map's ids (what it drafts from), labels outside it score nothing."""
    import zoo

    target = zoo.layout(zoo_dir).target
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    used = sorted({t for r in rows for t in r["output_ids"]})
    path = tmp_path / "map.json"
    path.write_text(json.dumps(used[: max(1, len(used) // 2)]))
    plan = TrainPlan(steps=2, batch_tokens=256, seq_len=128, positions=64, draft_vocab_size=512, save_every=2,
                     mtp_token_map=str(path))
    trainer = HeadTrainer(target, records, tmp_path / "ckpt", plan)
    assert trainer.mtp_rows.tolist() == json.loads(path.read_text())
    assert int((trainer.mtp_index >= 0).sum()) == len(trainer.mtp_rows)
    trainer.run()
    counted = [sum(n for _, n in r["mtp"]["agree"]) for r in trainer.history]
    assert trainer.step == 2 and all(0 < n for n in counted)
    assert all(l == l and l > 0 for l in (r["mtp"]["loss"] for r in trainer.history))
    agreement = trainer.agreement(records)  # MTP's argmax over its map, as the engine drafts
    by_source = agreement.pop("by_source")
    assert set(agreement) == {"mtp", "eagle3"} and all(0 <= a <= 1 for per in agreement.values() for a in per)
    assert by_source == {"test": agreement}  # every record here is of one source
    recall = trainer.agreement(records, top=8)  # the target's token among the head's 8 best: never below top 1
    assert recall.pop("top") == 8 and recall.pop("by_source") == {"test": recall}
    assert all(r >= a for name in agreement for r, a in zip(recall[name], agreement[name]))
    assert sum(recall["eagle3"]) > sum(agreement["eagle3"])


def test_a_run_can_train_one_head_and_keep_the_other_from_init(zoo_dir, records, tmp_path):
    """plan.train: a deeper EAGLE-3 unroll fine-tuned alone leaves MTP exactly as --init gave it."""
    import zoo

    target = zoo.layout(zoo_dir).target
    base = TrainPlan(steps=1, batch_tokens=256, seq_len=128, positions=64, draft_vocab_size=512)
    HeadTrainer(target, records, tmp_path / "a", base).export(tmp_path / "export")  # freshly initialized heads
    deeper = replace(base, steps=2, depth=5, train="eagle3")
    with pytest.raises(ValueError, match="--init"):
        HeadTrainer(target, records, tmp_path / "b", deeper)
    with pytest.raises(ValueError, match="name one or more"):
        HeadTrainer(target, records, tmp_path / "c", replace(base, train="medusa"), tmp_path / "export")
    with pytest.raises(ValueError, match="step_decay"):
        HeadTrainer(target, records, tmp_path / "c", replace(base, step_decay=0.0))
    trainer = HeadTrainer(target, records, tmp_path / "d", deeper, tmp_path / "export")
    before = {name: {k: v.clone() for k, v in head.state_dict().items()} for name, head in trainer.heads.items()}
    trainer.run()
    assert all(torch.equal(v, trainer.heads["mtp"].state_dict()[k]) for k, v in before["mtp"].items())
    assert not all(torch.equal(v, trainer.heads["eagle3"].state_dict()[k]) for k, v in before["eagle3"].items())
    assert [set(r) - {"step", "tokens", "seconds"} for r in trainer.history] == [{"eagle3"}] * 2
    assert all(len(r["eagle3"]["agree"]) <= 5 for r in trainer.history)


def test_source_weights_parse_and_name_what_is_wrong():
    assert parse_source_weights("") == {}
    assert parse_source_weights("jsonschemabench=2, chat=1.5,vicuna=0") == {"jsonschemabench": 2.0, "chat": 1.5,
                                                                           "vicuna": 0.0}
    for bad in ("chat", "chat=x", "=2", "chat=-1"):
        with pytest.raises(ValueError, match="SOURCE=WEIGHT"):
            parse_source_weights(bad)


def test_source_weights_oversample_rows_per_epoch():
    import random

    rng = random.Random(0)
    assert epoch_rows(None, 3, rng) == [0, 1, 2]
    assert sorted(epoch_rows([2.0, 0.0, 1.0], 3, rng)) == [0, 0, 2]
    halves = [epoch_rows([0.5], 1, rng) for _ in range(2000)]
    assert 900 < sum(len(h) for h in halves) < 1100  # a fractional weight: one more copy with that probability
    rows = [([1] * 9, [1.0] * 9), ([2] * 10, [1.0] * 10), ([3] * 11, [1.0] * 11)]
    group, ids, weight = next(batches(rows, 10_000, 0, rng, [3.0, 1.0, 0.0]))  # one epoch fits one batch
    assert sorted(group) == [0, 0, 0, 1] and ids.shape == (4, 10) and weight.sum() == 3 * 9 + 10


def test_guided_greedy_records_take_their_emitted_tokens_as_labels(records):
    """Under a grammar, verification accepts the argmax over the allowed tokens: for a greedy guided record that is
    the token the engine emitted, so those are its labels; other records keep the target's argmax."""
    assert emitted_from({"prompt_ids": [1, 2, 3], "output_ids": [4], "guided": True, "temperature": 0.0}) == 3
    assert emitted_from({"prompt_ids": [1, 2, 3], "output_ids": [4], "guided": True, "temperature": 0.7}) is None
    assert emitted_from({"prompt_ids": [1, 2, 3], "output_ids": [4], "guided": False}) is None
    top = torch.tensor([[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25]])
    ids = torch.tensor([[1, 2, 3, 4, 5, 0], [6, 7, 8, 9, 1, 2]])
    labels = emitted_labels(top, ids, [2, None], [5, 6])
    assert labels.tolist() == [[10, 3, 4, 5, 14, 15], top[1].tolist()]  # padding (index 5) untouched
    assert top[0, 1] == 11  # a new tensor
    sources, emitted = [], []
    rows = read_rows(records, 128, 0.2, sources, emitted)
    recs = [json.loads(line) for line in records.read_text().splitlines()]
    assert len(rows) == len(recs) == len(emitted) and sources == ["test"] * len(recs)
    assert emitted == [len(r["prompt_ids"]) if r["key"] == "t-1" else None for r in recs]


def test_the_trainer_refuses_source_weights_that_match_nothing(zoo_dir, records, tmp_path):
    import zoo

    target = zoo.layout(zoo_dir).target
    plan = TrainPlan(steps=1, batch_tokens=256, seq_len=128, positions=64, draft_vocab_size=512)
    with pytest.raises(ValueError, match=r"names \['chat'\]"):
        HeadTrainer(target, records, tmp_path / "a", replace(plan, source_weights="chat=2"))
    with pytest.raises(ValueError, match="leaves no record"):
        HeadTrainer(target, records, tmp_path / "b", replace(plan, source_weights="test=0"))
    trainer = HeadTrainer(target, records, tmp_path / "c", replace(plan, source_weights="test=2"))
    assert trainer.repeats == [2.0] * len(trainer.rows)
    trainer.run()
    assert trainer.step == 1


def test_agreement_takes_the_argmax_over_the_allowed_ids_only(monkeypatch):
    import zoo.distill as distill

    class Head:
        def to_target_vocab(self, logits):
            return logits

    # the head's logits favour id 2 everywhere, the target's argmax is id 1
    monkeypatch.setattr(distill, "unroll", lambda head, f, i, d: [torch.tensor([[[0.0, 1.0, 9.0]] * 4])])
    features = {"logits": torch.tensor([[[0.0, 5.0, 1.0]] * 4])}
    ids, real = torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.bool)
    assert distill.head_agreement(Head(), features, ids, real, 1) == [(0, 3)]
    allowed = torch.tensor([True, True, False])  # a token map without id 2
    assert distill.head_agreement(Head(), features, ids, real, 1, allowed=allowed) == [(3, 3)]
    assert distill.head_agreement(Head(), features, ids, real, 1, top=2) == [(3, 3)]  # id 1 is the head's second


def test_soft_labels_are_the_targets_distribution_where_no_grammar_overrode_its_argmax(zoo_dir, records, tmp_path):
    """plan.soft_weight: cross-entropy against softmax(target LM head . final hidden) at the label's index, mixed with
    the hard label by the weight; where the label is not the target's argmax (a grammar's choice) only the hard one."""
    import random

    import torch.nn.functional as F

    import zoo
    from zoo.distill import shift_left
    from zoo.selfdistill_train import SoftLabels, sampled_head_loss

    plan = TrainPlan(steps=1, batch_tokens=256, seq_len=128, positions=64, draft_vocab_size=512, soft_weight=0.5)
    trainer = HeadTrainer(zoo.layout(zoo_dir).target, records, tmp_path / "ckpt", plan)
    group, ids, weight = next(batches(trainer.rows, 256, trainer.pad, random.Random(0)))
    features, top = trainer.features(group, ids)
    head, index, target_head = trainer.heads["eagle3"], trainer.eagle_index, trainer.target_heads["eagle3"]

    def loss(soft):
        out, _ = sampled_head_loss(head, features, top, ids, weight, 1, None, index, 10**6, torch.Generator(), soft,
                                   target_head)
        return out

    hard = loss(None)
    assert torch.allclose(loss(SoftLabels(features["last_hidden"], torch.zeros_like(top, dtype=torch.bool), 1.0)), hard)
    # the reference, in plain torch: depth 1, every weighted position (no sampling at 10**6 positions)
    with torch.no_grad():
        b, t = ids.shape
        hidden = head.step_hidden(head.first_hidden(features), shift_left(ids, 1, 0), torch.arange(t).expand(b, t), [])
        label = index[top[:, 1: t - 1]]
        w = weight[:, 2:] * (label >= 0)
        keep = w.nonzero(as_tuple=True)
        logp = F.log_softmax(head.logits_from(hidden[:, : t - 2][keep]).float(), -1)
        p = F.softmax(features["last_hidden"][keep[0], keep[1] + 1] @ target_head.T, -1)
        hard_ce, soft_ce = -logp.gather(1, label[keep][:, None])[:, 0], -(p * logp).sum(-1)
        expected = ((0.5 * hard_ce + 0.5 * soft_ce) * w[keep]).sum() / w[keep].sum()
        got = loss(SoftLabels(features["last_hidden"], torch.ones_like(top, dtype=torch.bool), 0.5))
    assert torch.allclose(got, expected, rtol=1e-4) and not torch.allclose(got, hard)
    # plan.step_decay weighs unroll step d by decay**d: the loss is linear in it at depth 2
    with torch.no_grad():
        at = {d: sampled_head_loss(head, features, top, ids, weight, 2, None, index, 10**6, torch.Generator(), None,
                                   target_head, d)[0] for d in (0.0, 0.5, 1.0)}
    assert torch.allclose(at[0.5], (at[0.0] + at[1.0]) / 2, rtol=1e-4) and at[1.0] > at[0.0] > 0
    trainer.run()  # the trainer's own soft step
    assert trainer.step == 1 and all(r[n]["loss"] > 0 for r in trainer.history for n in ("mtp", "eagle3"))
