"""zoo.packing: whole JSON documents per row, code/text filling the rest, deterministic."""
import random

import torch

from zoo.packing import pack


def _docs():
    json_docs = [[1] + [100 + i] * (5 + i % 7) + [2] for i in range(20)]
    filler = [[1] + [50] * 9 for _ in range(5)]
    return json_docs, filler


def test_json_documents_never_straddle_rows():
    json_docs, filler = _docs()
    ids, weight = pack(json_docs, filler, 16, 40, 1.0, 0, random.Random(0))
    assert ids.shape == (40, 16) and (weight == 1).all()
    for row in ids.tolist():
        # the row is complete json documents (bos, body, eos), then filler tokens only
        i = 0
        while i + 1 < len(row) and row[i] == 1 and row[i + 1] >= 100:
            assert 2 in row[i:], "a json document was cut at the end of the row"
            j = row.index(2, i)
            assert len(set(row[i + 1: j])) == 1
            i = j + 1
        assert all(t in (1, 50) for t in row[i:])


def test_padding_only_without_filler_and_long_docs_dropped():
    json_docs, _ = _docs()
    ids, weight = pack(json_docs + [[1] * 40], [], 16, 10, 1.0, 0, random.Random(0))
    assert (ids[weight == 0] == 0).all() and (weight[ids != 0] == 1).all()
    assert not (ids == 1).all(dim=1).any()  # the 40-token document never appears


def test_deterministic():
    json_docs, filler = _docs()
    a = pack(json_docs, filler, 16, 30, 0.5, 0, random.Random(3))
    b = pack(json_docs, filler, 16, 30, 0.5, 0, random.Random(3))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_prompt_tokens_get_the_prompt_weight():
    json_docs = [[1, 7, 7, 7, 9, 9, 2]] * 3  # 4 prompt tokens, then the instance
    ids, weight = pack(json_docs, [], 14, 2, 1.0, 0, random.Random(0), prompt_lens=[4] * 3, prompt_weight=0.25)
    assert weight[0].tolist() == [0.25] * 4 + [1.0] * 3 + [0.25] * 4 + [1.0] * 3
