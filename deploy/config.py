"""TandemConfig: one deployment's settings (the `tandem serve` flags, the Serve YAML's `args`): the engine's
(cluster.settings), the prefill and decode deployments' own, and the router's, split into the per-role
configs that each deployment is given."""
from __future__ import annotations

from pathlib import Path

import os

from pydantic import BaseModel, Field, model_validator

from decode_worker.config import DecodeConfig
from prefill_worker.config import PrefillConfig
from router.config import API_KEY_ENV, RouterConfig, RouterSettings


class TandemConfig(PrefillConfig, DecodeConfig, RouterSettings):
    served_model_name: str | None = Field(None, description="Name clients use in `model`; default: the "
                                                            "directory's name.")
    prefill_replicas: int = Field(1, ge=1, description="Prefill replicas (one engine each).")
    decode_replicas: int = Field(1, ge=1, description="Decode replicas (one group of `tp` ranks each).")
    router_replicas: int = Field(1, ge=1, description="Router (HTTP ingress) replicas.")
    prefill_num_cpus: float = Field(1.0, ge=0, description="Ray CPUs per prefill replica.")

    @model_validator(mode="before")
    @classmethod
    def _api_key_from_env(cls, values):
        if isinstance(values, dict) and values.get("api_key") is None and os.environ.get(API_KEY_ENV):
            values = {**values, "api_key": os.environ[API_KEY_ENV]}
        return values

    @property
    def name(self) -> str:
        return self.served_model_name or Path(self.model).resolve().name

    def prefill(self) -> PrefillConfig:
        return _part(self, PrefillConfig)

    def decode(self) -> DecodeConfig:
        return _part(self, DecodeConfig)

    def router(self) -> RouterConfig:
        own = self.model_dump(include=set(RouterSettings.model_fields))
        return RouterConfig(model=self.model, served_model_name=self.name, **own)


def _part(cfg: TandemConfig, kind: type[BaseModel]):
    return kind(**cfg.model_dump(include=set(kind.model_fields)))
