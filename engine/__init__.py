"""Tandem's single-process runtime: `from engine import LLM, SamplingParams`.

No Ray here: one process, one device. The distributed workers wrap LLMEngine.
"""
from engine.config import EngineConfig, ModelConfig
from engine.errors import CapacityError, InvalidRequestError, ModelLoadError, TandemError, UnsupportedModelError
from engine.llm import LLM
from engine.grammar import StructuredOutput
from engine.handover import Handover, HandoverRequest
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.speculative.config import SpecConfig

__all__ = ["LLM", "LLMEngine", "EngineConfig", "ModelConfig", "SamplingParams", "SpecConfig", "StructuredOutput", "RequestOutput", "TokenLogprob",
           "Handover", "HandoverRequest", "TandemError", "InvalidRequestError", "ModelLoadError", "UnsupportedModelError",
           "CapacityError"]
