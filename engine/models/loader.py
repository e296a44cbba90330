"""Weight loading from HF checkpoint directories: single or sharded safetensors, any float dtype.

Each model parameter module owns the slicing of a full checkpoint tensor (tensor parallelism), so the
loader only maps names, converts dtypes and checks that nothing is missing or misshapen.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open

from engine.errors import ModelLoadError
from engine.layers.linear import copy_checked

log = logging.getLogger(__name__)


def safetensors_files(model_dir: str | Path) -> list[Path]:
    path = Path(model_dir)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {e}") from e
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names shard(s) that do not exist: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {path} (only safetensors checkpoints are supported)")
    return files


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)
        except (OSError, RuntimeError, ValueError) as e:
            if isinstance(e, ModelLoadError):
                raise
            raise ModelLoadError(f"cannot read weights from {f}: {e}") from e


def load_weights(model: torch.nn.Module, model_dir: str | Path, dtype: torch.dtype,
                 name_map=None) -> None:
    """Fill `model` from the checkpoint. `model.param_for(name)` maps names (optionally after `name_map`);
    `model.expected_checkpoint_names()` lists what must be present."""
    expected = model.expected_checkpoint_names()
    seen: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in iter_tensors(safetensors_files(model_dir)):
        if name_map is not None:
            name = name_map(name)
            if name is None:
                continue
        target = model.param_for(name)
        if target is None:
            if name in expected or "rotary_emb" in name:
                seen.add(name)
            else:
                unexpected.append(name)
            continue
        module, leaf, shard = target
        if not tensor.is_floating_point():
            raise ModelLoadError(f"weight {name!r} has dtype {tensor.dtype}, expected a floating-point tensor")
        if hasattr(module, "load"):  # parallel layers slice the full tensor for their rank
            # a module that keeps fp32 weights in any model dtype (an MoE router) gets them uncast
            module.load(name, tensor.to(torch.float32 if getattr(module, "fp32_weights", False) else dtype), shard)
        else:
            copy_checked(getattr(module, leaf), tensor.to(dtype), name)
        seen.add(name)
    missing = sorted(expected - seen)
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelLoadError(f"checkpoint {model_dir} is missing weight(s) {missing[:5]}{more}")
    if unexpected:
        log.warning("ignored %d unexpected checkpoint tensor(s), e.g. %s", len(unexpected), unexpected[:3])
