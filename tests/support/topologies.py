"""The serving topologies under test: one table for the CUDA tests and their CPU twins, so they cannot drift.

Each row is a deployment a user could write in deploy/serve.yaml: `serve_args` starts from that file's
`args` and changes only what the row names (device, sizes, GPUs per replica and per rank), and
deploy.app.build_app builds it exactly as `serve deploy` would. On CUDA a row needs `gpus` devices and
expects its hand-over to travel over `cuda_transport`; its CPU twin runs everywhere, with gloo (or
shared memory where the CUDA row shares one GPU, the twin of CUDA IPC).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

SERVE_YAML = Path(__file__).resolve().parents[2] / "deploy" / "serve.yaml"


@dataclass(frozen=True)
class Topology:
    name: str
    gpus: int  # CUDA devices the row needs (its CPU twin needs none)
    decode_tp: int
    cuda_transport: str  # what must carry the KV on CUDA: "ipc" (one GPU) or "nccl"
    cpu_transport: str = "gloo"  # ... and on the CPU twin
    attention_dp: int = 1
    # GPUs per prefill replica and per decode rank: below 1 when the row packs them onto one device.
    prefill_gpus: float = 1.0
    rank_gpus: float = 1.0
    kill_check: bool = False  # also kill a decode rank and check the group comes back
    not_built: str | None = None  # why the row cannot run yet (it is listed, and skipped with this reason)
    extra: dict = field(default_factory=dict)

    def serve_args(self, device: str, model: str, draft: str) -> dict:
        """deploy/serve.yaml's args for this row: the user's file, with the row's topology and test sizes."""
        args = dict(yaml.safe_load(SERVE_YAML.read_text())["applications"][0]["args"])
        args.update(model=model, served_model_name=self.name, device=device, dtype="float32", tp=self.decode_tp,
                    attention_dp=self.attention_dp, prefill_replicas=1, decode_replicas=1, num_kv_blocks=128,
                    max_num_seqs=16, max_num_batched_tokens=1024, max_inflight=64, speculative_method="mtp",
                    draft=draft, num_speculative_tokens=2, **self.extra)
        if device == "cuda":
            args.update(prefill_num_gpus=self.prefill_gpus, rank_num_gpus=self.rank_gpus)
        else:
            # The twin's processes share two cores: logical CPUs only keep Ray's placement honest.
            args.update(prefill_num_cpus=0.5, rank_num_cpus=0.5, handover_transport=self.twin_preference)
        return args

    @property
    def twin_preference(self) -> str:
        return "ipc" if self.cpu_transport == "ipc" else "auto"

    def transport(self, device: str) -> str:
        return self.cuda_transport if device == "cuda" else self.cpu_transport


TOPOLOGIES = [
    # Prefill and a decode rank on one GPU, two processes: NCCL cannot join them, CUDA IPC does.
    Topology("one-gpu", gpus=1, decode_tp=1, cuda_transport="ipc", cpu_transport="ipc", prefill_gpus=0.5,
             rank_gpus=0.5, kill_check=True),
    # Prefill on GPU 0, decode on GPU 1: the NCCL channel.
    Topology("two-gpu", gpus=2, decode_tp=1, cuda_transport="nccl"),
    # Prefill tp=1 -> decode tp=2: every rank gets its KV-head slice; NCCL all-reduce inside the group.
    Topology("decode-tp2", gpus=3, decode_tp=2, cuda_transport="nccl"),
    # ... with attention data parallelism: one rank gets each request's whole heads.
    Topology("decode-tp2-adp", gpus=3, decode_tp=2, attention_dp=2, cuda_transport="nccl"),
    # Prefill tp=2 -> decode tp=2 (hand-over of head slices between two TP layouts).
    Topology("prefill-tp2-decode-tp2", gpus=4, decode_tp=2, cuda_transport="nccl",
             not_built="prefill tensor parallelism is not built (a prefill replica is one engine on one device)"),
]

BY_NAME = {t.name: t for t in TOPOLOGIES}
