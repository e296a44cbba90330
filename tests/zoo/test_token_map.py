"""zoo/token_map.py: the hot vocabulary ranking shared by EAGLE-3's draft vocabulary and MTP token maps,
and `tandem zoo token-map`, whose map the engine reads (engine/speculative/token_map.py)."""
import json

import pytest
import torch
from safetensors.torch import load_file

import zoo
from engine.speculative.token_map import read_token_map
from zoo.cli import main
from zoo.token_map import hot_token_ids, token_counts


def test_counts_and_ranking():
    counts = token_counts([[3, 3, 1], [1, 3, 0], [5]], 6)
    assert counts.tolist() == [1, 2, 0, 3, 0, 1]
    assert hot_token_ids(counts, 2) == [1, 3]
    assert hot_token_ids(counts, 3) == [0, 1, 3]  # ties (0 and 5, once each): the lower id
    assert hot_token_ids(counts, 3, always=(4,)) == [1, 3, 4]  # never seen, kept anyway
    for size in (0, 7):
        with pytest.raises(ValueError, match="does not fit"):
            hot_token_ids(counts, size)


def test_the_command_reproduces_the_builders_eagle3_vocabulary(tmp_path):
    """The micro zoo's EAGLE-3 head drafts from the builder's ranking of the same corpus: the command must
    find exactly those ids (it rebuilds the corpus and counts with the zoo's tokenizer), and the engine
    must read its file."""
    recipe = zoo.RECIPES["micro"]
    root = zoo.layout(zoo.build("micro"))
    out = tmp_path / "map.json"
    assert main(["token-map", "--recipe", "micro", "--size", str(recipe.draft_vocab_size), "--out", str(out)]) == 0
    d2t = load_file(str(root.eagle3 / "model.safetensors"))["d2t"]
    want = (torch.arange(recipe.draft_vocab_size) + d2t).tolist()
    doc = json.loads(out.read_text())
    assert doc["token_ids"] == want and 0 < doc["corpus_coverage"] <= 1
    assert read_token_map(out, recipe.vocab_size).tolist() == want


def test_a_size_outside_the_vocabulary_exits_2(tmp_path, capsys):
    assert main(["token-map", "--recipe", "micro", "--size", "0", "--out", str(tmp_path / "m.json")]) == 2
    assert "--size must be in [1," in capsys.readouterr().err


def test_a_real_targets_map_ranks_its_self_distilled_responses(tmp_path):
    """`--selfdistill`: what the target wrote ranks first, its prompts order the ids no response used, the
    target's special ids are always in, and the engine reads the file."""
    root = zoo.layout(zoo.build("micro"))
    records = tmp_path / "data.jsonl"
    rows = [{"key": "a", "prompt_ids": [7, 7, 7, 9], "output_ids": [5, 5, 6]},
            {"key": "b", "prompt_ids": [8, 9], "output_ids": [6, 5]}]
    records.write_text("\n".join(json.dumps(r) for r in rows) + "\n{\"cut\n")  # a line cut by a stopped writer
    out = tmp_path / "map.json"
    assert main(["token-map", "--selfdistill", str(records), "--target", str(root.target), "--size", "5",
                 "--out", str(out)]) == 0
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(root.target))
    special = {t for t in (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) if t is not None}
    doc = json.loads(out.read_text())
    # responses by count (5 thrice, 6 twice), then ids no response used by their prompt counts (7, 9, 8)
    ranking = [5, 6, 7, 9, 8] + [t for t in range(zoo.RECIPES["micro"].vocab_size) if t not in (5, 6, 7, 8, 9)]
    assert doc["token_ids"] == sorted(list(dict.fromkeys(sorted(special) + ranking))[:5])
    assert doc["corpus_coverage"] == 1.0
    assert read_token_map(out, zoo.RECIPES["micro"].vocab_size).tolist() == doc["token_ids"]
    assert main(["token-map", "--selfdistill", str(records), "--size", "5", "--out", str(out)]) == 2  # no --target
