"""zoo.tokenizer: byte-level BPE saved as a transformers tokenizer."""
import json

import pytest
from transformers import AutoTokenizer

from zoo.prompts import SPECIAL_TOKENS
from zoo.tokenizer import TOKENIZER_FILES, save_tokenizer, train_tokenizer

TEXTS = ['{"name": "Ada", "tags": ["x", "y"]}', "def main():\n    print('hi')\n", "The cat sat."] * 40


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(train_tokenizer(TEXTS, 320), out, model_max_length=1024)
    return out


def test_files_and_config(tok_dir):
    assert all((tok_dir / name).is_file() for name in TOKENIZER_FILES)
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == ("<|bos|>", "<|end|>", "<|pad|>")
    assert config["chat_template"]


def test_special_tokens_have_fixed_ids_and_never_split(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    ids = tok("<|bos|><|user|>\nx<|end|>", add_special_tokens=False)["input_ids"]
    assert ids[:2] == [1, 4] and ids[-1] == 2


@pytest.mark.parametrize("text", [
    "plain ascii", "naïve café — “quotes”", "日本語のテキスト", "emoji 🦜🚀 and \t tabs\n\nnewlines",
    '{"κλειδί": "значение", "n": -1.5e3}', "", " leading and trailing spaces ",
])
def test_round_trip(tok_dir, text):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text


def test_no_implicit_bos(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert tok("abc")["input_ids"] == tok("abc", add_special_tokens=False)["input_ids"]


def test_training_is_deterministic():
    a = train_tokenizer(TEXTS, 300).to_str()
    b = train_tokenizer(TEXTS, 300).to_str()
    assert a == b
