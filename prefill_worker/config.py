"""PrefillConfig: the prefill deployment's settings, the engine's (cluster.settings) plus its own."""
from __future__ import annotations

from pydantic import Field

from cluster.settings import EngineSettings


class PrefillConfig(EngineSettings):
    connect_timeout_s: float = Field(30.0, gt=0, description="Deadline for opening a channel to a decode rank.")
