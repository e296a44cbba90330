"""DecodeConfig: the decode deployment's settings, the engine's (cluster.settings) plus its own."""
from __future__ import annotations

from pydantic import Field, model_validator

from cluster.resources import CustomResources, engine_gpus
from cluster.settings import EngineSettings


class DecodeConfig(EngineSettings):
    tp: int = Field(2, ge=1, description="Tensor-parallel ranks per decode group (one group per decode replica).")
    attention_dp: int = Field(1, ge=1, description="Attention data parallelism inside a decode group: 1 = off "
                                                   "(attention heads sharded over the tp ranks); equal to tp = each "
                                                   "rank owns its requests' whole-head KV and the MLP stays sharded.")
    expert_parallel: bool = Field(False, description="MoE models (DeepSeek-V3, Qwen3-MoE): the routed experts sharded "
                                                     "whole over the tp ranks (each holds num_experts / tp of them) "
                                                     "instead of every expert's intermediate dim; with attention_dp "
                                                     "= tp this is DeepSeek's serving layout (DP attention + EP "
                                                     "MoE). No effect on dense models.")
    handover_stock: float = Field(0.125, ge=0, lt=1, description="Share of each decode rank's KV blocks set aside "
                                                                 "for incoming hand-overs, so that a payload is let "
                                                                 "in as soon as its header arrives instead of after "
                                                                 "a lockstep RESERVE at the group's next step (the "
                                                                 "blocks go to the requests that land in them and "
                                                                 "the stock is refilled); 0 = off.")
    tp_shm: bool = Field(True, description="CPU decode ranks of one x86 host make their tensor-parallel all-reduces "
                                           "and gathers (under attention data parallelism: the MLP row exchanges and "
                                           "the step agreement) through shared memory (engine/distributed/shm_collectives.py); "
                                           "ranks that cannot share a segment (other hosts or containers) use gloo "
                                           "all the same. false: gloo always.")
    rank_num_cpus: float = Field(1.0, ge=0, description="Ray CPUs reserved per decode rank.")
    rank_num_gpus: float | None = Field(None, ge=0, le=1, description="GPUs reserved per decode rank (in its "
                                                                      "placement-group bundle); default: 1 on "
                                                                      "cuda, 0 on cpu; a share (0.5) lets a rank "
                                                                      "and a prefill replica share one GPU.")
    rank_resources: CustomResources = Field({}, description="Custom Ray resources per decode rank, in each "
                                                            "placement-group bundle, so that ranks land on nodes "
                                                            "that declare them, e.g. {\"tandem_decode\": 1}.")
    handover_timeout_s: float = Field(60.0, gt=0, description="How long a decode stream waits for its hand-over "
                                                              "header.")
    steps_in_flight: int = Field(2, ge=1, le=4, description="Group steps the replica keeps submitted to its ranks: "
                                                            "2 queues step N+1 at the ranks while they run step N, "
                                                            "so they never wait for the replica to read a report "
                                                            "and send the next step; commands then take effect one "
                                                            "step later. 1 = strict lockstep.")
    step_timeout_s: float = Field(120.0, gt=0, description="A decode step slower than this is treated as a dead "
                                                           "group (which is rebuilt).")

    @model_validator(mode="after")
    def _check_attention_dp(self):
        if self.attention_dp not in (1, self.tp):
            raise ValueError(f"attention_dp must be 1 (off) or equal to tp ({self.tp}), got {self.attention_dp}")
        return self

    @model_validator(mode="after")
    def _check_rank_gpus(self):
        self.rank_gpus()
        return self

    def rank_gpus(self) -> float:
        """GPUs a decode rank reserves: rank_num_gpus, or the device's default."""
        return engine_gpus(self.device, self.rank_num_gpus, "rank_num_gpus")
