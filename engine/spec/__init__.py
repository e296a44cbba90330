"""Speculative decoding inside the engine's step: MTP and EAGLE-3 heads, a separate draft model, or
prompt lookup, with lossless verification (engine/spec/step.py is the step)."""
from engine.spec.config import SpecConfig

__all__ = ["SpecConfig"]
