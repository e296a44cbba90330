"""TandemConfig: one deployment's settings (the `tandem serve` flags, the Serve YAML's `args`): the engine's
(cluster.settings), the prefill and decode deployments' own, and the router's, split into the per-role
configs that each deployment is given."""
from __future__ import annotations

from pathlib import Path

import os

from pydantic import BaseModel, Field, model_validator

from cluster.resources import CustomResources, engine_gpus
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
    prefill_num_gpus: float | None = Field(None, ge=0, le=1, description="GPUs per prefill replica; default: 1 on "
                                                                         "cuda, 0 on cpu; a share (0.5) lets it "
                                                                         "and a decode rank share one GPU.")
    prefill_resources: CustomResources = Field({}, description="Custom Ray resources per prefill replica, so that "
                                                               "prefill lands on nodes that declare them, e.g. "
                                                               "{\"tandem_prefill\": 1}.")
    router_resources: CustomResources = Field({}, description="Custom Ray resources per router replica and per "
                                                              "decode replica (both hold no engine; the decode "
                                                              "replica steers its ranks): e.g. one only the head "
                                                              "node declares, so that losing a worker node loses "
                                                              "no replica, only ranks that are rebuilt.")

    @model_validator(mode="before")
    @classmethod
    def _api_key_from_env(cls, values):
        if isinstance(values, dict) and values.get("api_key") is None and os.environ.get(API_KEY_ENV):
            values = {**values, "api_key": os.environ[API_KEY_ENV]}
        return values

    @model_validator(mode="after")
    def _check_prefill_gpus(self):
        self.prefill_gpus()
        return self

    def prefill_gpus(self) -> float:
        """GPUs a prefill replica reserves: prefill_num_gpus, or the device's default."""
        return engine_gpus(self.device, self.prefill_num_gpus, "prefill_num_gpus")

    @property
    def name(self) -> str:
        return self.served_model_name or Path(self.model).resolve().name

    def custom_resources_needed(self) -> dict[str, float]:
        """The custom resources every replica and rank together ask for (what one machine must declare to run
        a configuration written for a cluster)."""
        asks = [(self.prefill_replicas, self.prefill_resources), (self.decode_replicas * self.tp, self.rank_resources),
                (self.router_replicas + self.decode_replicas, self.router_resources)]
        needed: dict[str, float] = {}
        for count, resources in asks:
            for name, amount in resources.items():
                needed[name] = needed.get(name, 0) + count * amount
        return needed

    def prefill(self) -> PrefillConfig:
        return _part(self, PrefillConfig)

    def decode(self) -> DecodeConfig:
        return _part(self, DecodeConfig)

    def router(self, api: tuple[str, int] | None = None) -> RouterConfig:
        """api: (host, port) the router replicas serve HTTP on themselves (direct ingress); None: Serve's
        HTTP proxy brings the requests."""
        own = self.model_dump(include=set(RouterSettings.model_fields))
        where = {"api_host": api[0], "api_port": api[1]} if api is not None else {}
        return RouterConfig(model=self.model, served_model_name=self.name, **own, **where)


def _part(cfg: TandemConfig, kind: type[BaseModel]):
    return kind(**cfg.model_dump(include=set(kind.model_fields)))
