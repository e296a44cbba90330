"""Speculative decoding inside the engine's step: MTP and EAGLE-3 heads, a separate draft model, or
prompt lookup, with lossless verification (engine/speculative/step.py is the step)."""
from engine.speculative.config import SpecConfig

__all__ = ["SpecConfig"]
