"""Tandem's single-process runtime: `from engine import LLM, SamplingParams`.

No Ray here: one process, one device. The distributed workers wrap LLMEngine.

The names below load on first use (PEP 562), so a light client (the router, the prefill loop,
structured/) that takes an error class or SamplingParams from here does not load torch, Triton and
the model code with it.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> the module that defines it
_EXPORTS = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "EngineConfig": "engine.config",
    "ModelConfig": "engine.config",
    "SamplingParams": "engine.sampling_params",
    "SpecConfig": "engine.config",
    "StructuredOutput": "structured.request",
    "RequestOutput": "engine.outputs",
    "TokenLogprob": "engine.outputs",
    "Continuation": "engine.core.request",
    "Handover": "engine.handover",
    "HandoverRequest": "engine.handover",
    "TandemError": "engine.errors",
    "InvalidRequestError": "engine.errors",
    "ModelLoadError": "engine.errors",
    "UnsupportedModelError": "engine.errors",
    "CapacityError": "engine.errors",
}
__all__ = list(_EXPORTS)

if TYPE_CHECKING:
    from engine.config import EngineConfig, ModelConfig, SpecConfig
    from engine.core.request import Continuation
    from engine.errors import CapacityError, InvalidRequestError, ModelLoadError, TandemError, UnsupportedModelError
    from engine.handover import Handover, HandoverRequest
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.outputs import RequestOutput, TokenLogprob
    from engine.sampling_params import SamplingParams
    from structured.request import StructuredOutput


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
