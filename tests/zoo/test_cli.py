"""`tandem zoo ...` (zoo.cli): train-draft on a real HF target, typed errors, path and eval output."""
import json

import pytest
import torch
from safetensors.torch import load_file

import zoo
from zoo.cli import main
from zoo.heads.eagle3 import EAGLE3_WEIGHT_NAMES, Eagle3Head
from zoo.heads.mtp import MTPHead
from zoo.report import markdown


@pytest.fixture(scope="module")
def micro_zoo():
    return zoo.build("micro")


@pytest.fixture()
def data_file(tmp_path):
    rows = [{"schema": {"type": "object", "properties": {"n": {"type": "integer"}}}, "instance": {"n": i}}
            for i in range(12)]
    rows += [{"text": "def add(a, b):\n    return a + b\n"}, {"messages": [{"role": "user", "content": "hi"}]}]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_train_draft_writes_a_loadable_head(micro_zoo, data_file, tmp_path, kind, capsys):
    out = tmp_path / kind
    rc = main(["train-draft", "--target", str(zoo.layout(micro_zoo).target), "--kind", kind,
               "--data", str(data_file), "--out", str(out), "--steps", "3", "--batch-size", "2",
               "--seq-len", "64", "--device", "cpu"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["kind"] == kind and summary["documents"] == 14
    state = load_file(str(out / "model.safetensors"))
    if kind == "eagle3":
        assert set(state) == set(EAGLE3_WEIGHT_NAMES)
        assert Eagle3Head.load(out).lm_head.weight.shape[0] == json.loads((out / "config.json").read_text())["draft_vocab_size"]
    else:
        assert MTPHead.load(out).layer_index == 4
    assert all(torch.isfinite(t.float()).all() for t in state.values())


def test_train_draft_reports_a_missing_data_file(micro_zoo, tmp_path, capsys):
    rc = main(["train-draft", "--target", str(zoo.layout(micro_zoo).target), "--kind", "mtp",
               "--data", str(tmp_path / "absent.jsonl")])
    assert rc == 1
    assert "does not exist" in capsys.readouterr().err


def test_train_draft_reports_a_bad_line(micro_zoo, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"neither": 1}\n')
    rc = main(["train-draft", "--target", str(zoo.layout(micro_zoo).target), "--kind", "eagle3", "--data", str(bad)])
    assert rc == 1
    assert "bad.jsonl:2" in capsys.readouterr().err


def test_path_prints_the_built_zoo(micro_zoo, capsys):
    assert main(["path", "--size", "micro"]) == 0
    assert capsys.readouterr().out.strip() == str(micro_zoo)


def test_eval_writes_json_and_markdown(micro_zoo, tmp_path, capsys):
    rc = main(["eval", "--zoo", str(micro_zoo), "--results", str(tmp_path), "--docs", "3", "--prompts", "2",
               "--max-new-tokens", "24", "--text-prompts", "2"])
    assert rc == 0
    result = json.loads((tmp_path / "zoo_eval.json").read_text())
    assert len(result["agreement"]["mtp/instance"]) == 3 and len(result["agreement"]["eagle3/all"]) == 3
    bands = result["agreement"]["by_confidence"]
    assert len(bands["positions"]) == len(bands["bands"]) == len(bands["mtp"]) == len(bands["draft"])
    assert set(result["target_loss"]) >= {"json", "json_instance"}
    assert set(result["acceptance"]) >= {"mtp", "eagle3", "ngram"} and result["constrained"]["prompts"] == 2
    assert set(result["acceptance_text"]) >= {"mtp", "eagle3", "ngram"} and result["acceptance_text"]["prompts"] <= 2
    assert 0 <= result["generation"]["degenerate"] <= 1
    assert (tmp_path / "zoo_eval.md").read_text() == markdown(result)
