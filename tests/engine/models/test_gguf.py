"""engine/models/gguf.py: a GGUF file converted once into an HF directory, against transformers' own GGUF
loader (the reference) on the real SmolLM2 file, plus the typed errors and the cache."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from engine import EngineConfig, UnsupportedModelError
from engine.models.gguf import gguf_model_dir


@pytest.fixture(scope="module")
def smollm2_gguf(smollm2_dir):
    from zoo.models import smollm2_gguf

    return smollm2_gguf()


def test_converted_weights_equal_transformers_gguf_loader(smollm2_gguf, smollm2_dir):
    pytest.importorskip("accelerate", reason="transformers' GGUF loader (the reference) needs accelerate")
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                               dtype=torch.float32).state_dict()
    mine = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).state_dict()
    assert set(mine) <= set(ref)
    for name, tensor in mine.items():
        assert torch.equal(tensor, ref[name]), name


def test_tokenizer_and_chat_template_come_from_the_file(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>" and tok.decode(tok("Hello world")["input_ids"]) == "Hello world"


def test_a_gguf_path_loads_through_its_cached_directory(smollm2_gguf, smollm2_dir):
    before = os.stat(os.path.join(smollm2_dir, "model.safetensors")).st_mtime_ns
    assert EngineConfig(model=str(smollm2_gguf)).model == smollm2_dir
    assert os.stat(os.path.join(smollm2_dir, "model.safetensors")).st_mtime_ns == before  # not converted again


def _write_gguf(path, arch: str) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    writer.add_feed_forward_length(16)
    writer.add_context_length(32)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_an_unsupported_architecture_is_a_typed_error_naming_it(tmp_path):
    path = tmp_path / "tiny-gpt2.gguf"
    _write_gguf(path, "gpt2")
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        gguf_model_dir(path, cache=tmp_path / "cache")
    assert not list((tmp_path / "cache" / "gguf").glob("tiny-gpt2*"))  # nothing half-converted is left


def test_a_missing_or_unreadable_file_is_a_typed_error(tmp_path):
    from engine import ModelLoadError

    with pytest.raises(ModelLoadError, match="does not exist"):
        gguf_model_dir(tmp_path / "absent.gguf", cache=tmp_path)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        gguf_model_dir(bad, cache=tmp_path)
