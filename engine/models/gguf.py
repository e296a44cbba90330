"""GGUF checkpoints: converted once into an HF-format directory in a content-addressed cache.

`LLM("model.gguf")`, `--model model.gguf` and `EngineConfig(model="model.gguf")` all go through
`gguf_model_dir`, which returns `<cache>/gguf/<stem>-<sha256[:16]>/` (config.json, model.safetensors,
tokenizer files with the chat template of the file's metadata, generation_config.json), converting the file
the first time. Every process that later loads the model (the Ray actors of `tandem serve`) reads that
directory, so a 100 MB file is dequantized once per machine, not once per actor; concurrent first calls
each convert into a private temporary directory and the first rename wins.

Reading and dequantizing go through the ggml project's `gguf` package (GGUFReader, gguf.quants); the
tokenizer is rebuilt from the file's vocabulary and merges by transformers' GGUF tokenizer converter.
Weights are stored dequantized in float32 (the engine casts to its dtype at load), so the directory is the
quantized model's exact values, not the original unquantized checkpoint's.

Supported: the `llama` GGUF architecture (Llama 1-3, Mistral, SmolLM and other models written as llama by
llama.cpp's convert_hf_to_gguf.py), with any quantization type `gguf.quants` dequantizes. Anything else is
an UnsupportedModelError naming the architecture or the tensor type.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from engine.errors import ModelLoadError, UnsupportedModelError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # part of the cache key: bump when the converted directory's contents change
_DONE = "gguf_source.json"  # written last: a directory without it is an interrupted conversion

# GGUF tensor name (after the "blk.N." prefix) -> HF Llama name (after "model.layers.N.").
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
SUPPORTED_ARCHITECTURES = ("llama",)


def is_gguf(path: str | os.PathLike) -> bool:
    return str(path).lower().endswith(".gguf")


def cache_root() -> Path:
    root = os.environ.get("TANDEM_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "tandem"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def gguf_model_dir(path: str | os.PathLike, cache: Path | None = None) -> Path:
    """The converted HF directory of GGUF file `path`, converting it first if the cache has none."""
    src = Path(path).expanduser()
    if not src.is_file():
        raise ModelLoadError(f"GGUF file {src} does not exist")
    sha = file_sha256(src)
    out = (cache or cache_root()) / "gguf" / f"{src.stem}-{sha[:16]}-v{FORMAT_VERSION}"
    if (out / _DONE).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        log.info("converting %s into %s (once per file content)", src, out)
        convert(src, tmp)
        (tmp / _DONE).write_text(json.dumps({"source": str(src), "sha256": sha, "format": FORMAT_VERSION}) + "\n")
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / _DONE).is_file():  # not another converter's finished copy: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _reader(src: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(str(src))
    except (ValueError, OSError) as e:
        raise ModelLoadError(f"{src} is not a readable GGUF file: {e}") from e


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader, src: Path) -> dict:
    """The HF LlamaConfig dict of a llama-architecture GGUF file, from its metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} in {src} is not supported; "
                                    f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
        "vocab_size": int(vocab), "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(_field(reader, f"{arch}.rope.dimension_count", hidden // heads)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id", eos),
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02,
    }
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise UnsupportedModelError(f"GGUF rope scaling {scaling!r} in {src} is not supported yet")
    return config


def _unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its converter interleaves each head's rotary halves for
    ggml's RoPE; HF's rotate-half layout keeps them as two halves)."""
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_tensors(reader, config: dict, src: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the file dequantized to float32 under its HF name."""
    from gguf import quants

    out = {}
    for tensor in reader.tensors:
        name = tensor.name
        if name.startswith("blk."):
            _, layer, rest = name.split(".", 2)
            hf = _LAYER_TENSORS.get(rest)
            hf = hf and f"model.layers.{layer}.{hf}"
        else:
            hf = _GLOBAL_TENSORS.get(name)
        if hf is None:
            if "rope_freqs" in name:
                raise UnsupportedModelError(f"{src}: tensor {name!r} (per-frequency RoPE factors) is not supported")
            raise UnsupportedModelError(f"{src}: GGUF tensor {name!r} has no place in a Llama model")
        try:
            values = quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as e:
            raise UnsupportedModelError(f"{src}: tensor {name!r} has quantization type {tensor.tensor_type.name}, "
                                        f"which the gguf package cannot dequantize ({e})") from e
        values = np.asarray(values, dtype=np.float32).reshape([int(d) for d in reversed(tensor.shape)])
        if hf.endswith("q_proj.weight"):
            values = _unpermute(values, config["num_attention_heads"])
        elif hf.endswith("k_proj.weight"):
            values = _unpermute(values, config["num_key_value_heads"])
        out[hf] = torch.from_numpy(np.array(values, copy=True, order="C"))
    return out


def convert(src: Path, out: Path) -> None:
    """Write the HF-format directory of GGUF file `src` into `out` (which exists)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    reader = _reader(src)
    config = gguf_config(reader, src)
    save_file(gguf_tensors(reader, config, src), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config[k] is not None}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise UnsupportedModelError(f"{src}: its tokenizer cannot be rebuilt from the GGUF metadata: {e}") from e
    template = _field(reader, "tokenizer.chat_template")
    if template:
        tokenizer.chat_template = template
    tokenizer.save_pretrained(str(out))
