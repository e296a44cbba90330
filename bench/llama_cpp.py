"""llama.cpp on the same weights at the same precision, for `python -m bench.real_model decode`.

What a CPU user would run instead of Tandem: llama.cpp through its Python binding (`pip install
llama-cpp-python`, which builds llama.cpp from source for this CPU; it is a benchmark-only dependency, never
installed by `make`). The default model ships as a Q4_1 GGUF; comparing that file against Tandem's fp32/bf16
weights would compare precisions, not engines. So the same GGUF is rewritten with every quantized tensor
dequantized to f32 (or bf16), the metadata and tokenizer copied as they are, in GGUF's own layout (no
HF round trip, so none of the converter's q/k row permutations): the weights both engines then run are the
dequantized Q4_1 values Tandem loads (engine/models/gguf.py).
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np

_FILE_TYPES = {"f32": 0, "bf16": 32}  # llama.cpp's LlamaFileType ALL_F32 / MOSTLY_BF16


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def write_dense_gguf(src: Path, dst: Path, precision: str) -> Path:
    """dst: src with its quantized tensors dequantized to `precision` (f32 or bf16; 1-D tensors stay f32, as
    llama.cpp's converter keeps norms). Written once; an existing dst is reused."""
    import gguf

    if dst.exists():
        return dst
    reader = gguf.GGUFReader(str(src))
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_suffix(".part")
    writer = gguf.GGUFWriter(str(tmp), arch=arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer adds these itself
        if field.name == gguf.Keys.General.FILE_TYPE:
            writer.add_file_type(_FILE_TYPES[precision])
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if precision == "bf16" and values.ndim > 1:
            writer.add_tensor(t.name, gguf.quants.quantize(values, gguf.GGMLQuantizationType.BF16),
                              raw_dtype=gguf.GGMLQuantizationType.BF16)
        else:
            writer.add_tensor(t.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(dst)
    return dst


class LlamaCpp:
    """One llama.cpp model, greedy decode from token ids at batch 1 (the binding's high-level API has no
    batches)."""

    def __init__(self, path: Path, threads: int, n_ctx: int = 1024):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                         n_batch=512, verbose=False)

    def generate(self, prompt: list[int], new_tokens: int) -> tuple[list[int], float]:
        """(tokens, seconds): the prompt's prefill and `new_tokens` greedy tokens, EOS ignored (as the engine's
        ignore_eos run), the KV cache reset first."""
        self.llm.reset()
        out: list[int] = []
        start = time.perf_counter()
        for token in self.llm.generate(prompt, top_k=1, temp=0.0, reset=True):
            out.append(int(token))
            if len(out) == new_tokens:
                break
        return out, time.perf_counter() - start
