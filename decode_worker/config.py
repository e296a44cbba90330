"""DecodeConfig: the decode deployment's settings, the engine's (cluster.settings) plus its own."""
from __future__ import annotations

from pydantic import Field

from cluster.settings import EngineSettings


class DecodeConfig(EngineSettings):
    tp: int = Field(2, ge=1, description="Tensor-parallel ranks per decode group (one group per decode replica).")
    rank_num_cpus: float = Field(1.0, ge=0, description="Ray CPUs reserved per decode rank.")
    handover_timeout_s: float = Field(60.0, gt=0, description="How long a decode stream waits for its hand-over "
                                                              "header.")
    step_timeout_s: float = Field(120.0, gt=0, description="A decode step slower than this is treated as a dead "
                                                           "group (which is rebuilt).")
