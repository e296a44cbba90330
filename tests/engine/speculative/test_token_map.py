"""engine/speculative/token_map.py: a draft head drafting from a hot vocabulary (SpecConfig.token_map).

The file formats and every way a map can be wrong (a typed error naming the file); then the engine:
an MTP head (and an EAGLE-3 head with the target's whole vocabulary) with a map drafts only the map's
ids, and greedy output, guided or not, equals decoding without speculation (the map changes drafts,
never outputs). Sampled output keeps the target's distribution: tests/engine/speculative/test_spec_distribution.py.
"""
from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SpecConfig
from engine.errors import ModelLoadError
from engine.speculative.token_map import read_token_map
from tests.support.draft_heads import make_eagle3_head, make_mtp_head
from tests.support.guided import guided_batch, is_valid
from tests.support.spec import greedy_params, random_prompts
from tests.support.tiny import VOCAB

# The map of the engine tests: a third of the vocabulary, so that some of the head's favourite tokens
# are out of reach and its drafts differ from the unrestricted head's.
MAP_IDS = list(range(0, VOCAB, 3))


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread_module):
    """Tiny models: one intra-op thread (tests/engine/conftest.py)."""


@pytest.fixture(scope="module")
def token_map(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("token_map") / "map.json"
    path.write_text(json.dumps(MAP_IDS))
    return str(path)


# ------------------------------------------------------------------------------ reading a map
@pytest.mark.parametrize("fmt", ["json_list", "json_dict", "torch"])
def test_formats_read_as_sorted_ids(tmp_path, fmt):
    ids = [9, 2, 40, 7]
    path = tmp_path / ("map.pt" if fmt == "torch" else "map.json")
    if fmt == "torch":  # SGLang's format: a saved 1-d tensor
        torch.save(torch.tensor(ids, dtype=torch.int32), path)
    else:
        path.write_text(json.dumps(ids if fmt == "json_list" else {"token_ids": ids}))
    got = read_token_map(path, 50)
    assert got.dtype == torch.int64 and got.tolist() == [2, 7, 9, 40]


@pytest.mark.parametrize("content,message", [
    (None, "does not exist"),
    ("{not json", "cannot read"),
    ("[1, 2.5]", "list of integer token ids"),
    ("[true, 2]", "list of integer token ids"),
    ('{"ids": [1]}', "list of integer token ids"),
    ("[]", "is empty"),
    ("[3, 50]", "outside the target vocabulary [0, 50)"),
    ("[-1, 3]", "outside the target vocabulary"),
    ("[4, 2, 4]", "more than once"),
])
def test_a_bad_map_is_a_typed_error_naming_the_file(tmp_path, content, message):
    path = tmp_path / "map.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ModelLoadError) as e:
        read_token_map(path, 50)
    assert message in str(e.value) and str(path) in str(e.value)


def test_a_torch_file_must_hold_a_1d_integer_tensor(tmp_path):
    path = tmp_path / "map.pt"
    torch.save(torch.zeros(2, 3, dtype=torch.int64), path)
    with pytest.raises(ModelLoadError, match="1-d tensor of token ids"):
        read_token_map(path, 50)
    torch.save(torch.tensor([1.0, 2.0]), path)
    with pytest.raises(ModelLoadError, match="1-d tensor of token ids"):
        read_token_map(path, 50)


def test_only_draft_heads_take_a_map():
    for method, draft in (("ngram", None), ("draft_model", "/some/dir")):
        with pytest.raises(ValueError, match="token map"):
            SpecConfig(method=method, k=3, draft=draft, token_map="map.json")


# ------------------------------------------------------------------------------ in the engine
def _recorded_drafts(llm: LLM) -> list[torch.Tensor]:
    """Wraps the proposer so that every draft it makes is kept (an instance attribute; the class is untouched)."""
    proposer = llm.engine.runner.proposer
    seen, propose = [], proposer.propose

    def recording(inp):
        drafts, probs = propose(inp)
        if drafts is not None:
            seen.append(drafts.clone())
        return drafts, probs

    proposer.propose = recording
    return seen


@pytest.mark.parametrize("method", ["mtp", "eagle3_full_vocab"])
def test_a_head_with_a_map_drafts_only_its_ids_and_greedy_output_is_unchanged(llama_dir, spec_drafts, token_map,
                                                                              tmp_path, method):
    draft = spec_drafts["mtp"] if method == "mtp" else str(make_eagle3_head(tmp_path / "e3", llama_dir, seed=3,
                                                                            draft_vocab=None))
    kind = method.removesuffix("_full_vocab")
    prompts = random_prompts(6, seed=11)
    ref = LLM(llama_dir, num_kv_blocks=256, block_size=4).generate(prompts, greedy_params(24))
    llm = LLM(llama_dir, num_kv_blocks=256, block_size=4,
              speculative=SpecConfig(method=kind, k=3, draft=draft, token_map=token_map))
    head = llm.engine.runner.proposer.head
    assert head.vocab_head().weight.shape[0] == len(MAP_IDS) and head.draft_vocab_size == len(MAP_IDS)
    drafts = _recorded_drafts(llm)
    outs = llm.generate(prompts, greedy_params(24))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    drafted = torch.cat([d.flatten() for d in drafts]).unique()
    assert set(drafted.tolist()) <= set(MAP_IDS)
    assert llm.engine.stats()["kv_blocks_used"] == 0
    # the restricted head's logits are the whole head's at the map's ids
    full = LLM(llama_dir, num_kv_blocks=16, block_size=4, speculative=SpecConfig(method=kind, k=3, draft=draft))
    state = torch.randn(5, head.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        torch.testing.assert_close(head.compute_logits(state),
                                   full.engine.runner.proposer.head.compute_logits(state)[:, MAP_IDS])


def test_guided_output_with_a_map_equals_guided_plain_decoding(llama_dir, spec_drafts, token_map):
    """The draft steps' grammar masks go through the map (its d2t), as for an EAGLE-3 draft vocabulary."""
    prompts, params, kinds = guided_batch(8)
    ref = LLM(llama_dir, num_kv_blocks=512, block_size=4).generate(prompts, params)
    llm = LLM(llama_dir, num_kv_blocks=512, block_size=4,
              speculative=SpecConfig(method="mtp", k=3, draft=spec_drafts["mtp"], token_map=token_map))
    for o, r, p, kind in zip(llm.generate(prompts, params), ref, params, kinds):
        if p.temperature == 0:
            assert o.token_ids == r.token_ids, kind
        if kind is not None:
            assert o.finish_reason == "stop" and is_valid(kind, o.text), (kind, o.text)


def test_a_head_with_a_vocabulary_of_its_own_refuses_a_map(llama_dir, spec_drafts, token_map):
    with pytest.raises(ModelLoadError, match="already drafts from a vocabulary of its own"):
        LLM(llama_dir, num_kv_blocks=64, block_size=4,
            speculative=SpecConfig(method="eagle3", k=3, draft=spec_drafts["eagle3"], token_map=token_map))


def test_the_targets_lm_head_is_untouched(llama_dir, token_map, tmp_path):
    """An MTP checkpoint without shared_head.head drafts through the target's LM head: the map copies its
    rows into a head of the MTP's own, and the target keeps all of its vocabulary."""
    draft = make_mtp_head(tmp_path / "mtp", llama_dir, seed=1, shared=False)
    plain = LLM(llama_dir, num_kv_blocks=64, block_size=4)
    llm = LLM(llama_dir, num_kv_blocks=64, block_size=4,
              speculative=SpecConfig(method="mtp", k=3, draft=str(draft), token_map=token_map))
    target_head = llm.engine.runner.model.lm_head
    head = llm.engine.runner.proposer.head.vocab_head()
    assert head is not target_head and target_head.weight.shape[0] == VOCAB
    torch.testing.assert_close(target_head.weight, plain.engine.runner.model.lm_head.weight, rtol=0, atol=0)
    torch.testing.assert_close(head.weight, target_head.weight[MAP_IDS], rtol=0, atol=0)
    prompts = random_prompts(3, seed=12)
    assert ([o.token_ids for o in llm.generate(prompts, greedy_params(16))]
            == [o.token_ids for o in plain.generate(prompts, greedy_params(16))])
