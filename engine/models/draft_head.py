"""What a one-model draft head (MTP, EAGLE-3) is to the speculative step, and how heads load.

A head runs at sequence index i on (a hidden state for index i, the token at i+1) and predicts the
token at i+2; its attention writes K/V for index i into its own layer of the paged cache. The first
step of a chain reads the target's hidden states (`first_hidden`); later steps read the head's own
previous output (`forward`'s return value), one position further each time.
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.config import ModelConfig, SUPPORTED_ARCHITECTURES
from engine.errors import ModelLoadError
from engine.layers.linear import LMHead
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import safetensors_files


class DraftHead(nn.Module, ABC):
    """Base of the heads: the forward contract plus checkpoint-name resolution for the loader."""

    FUSED = LlamaForCausalLM.FUSED  # checkpoint q/k/v and gate/up -> our fused parameters
    capture_layers: tuple[int, ...] = ()  # target layers (0-based) whose outputs first_hidden reads
    draft_vocab_size: int | None = None  # set when the head's vocabulary is a subset of the target's; then
    # a buffer `draft_to_target` [draft_vocab] int64 holds the target id of each draft id

    @abstractmethod
    def first_hidden(self, final_hidden: torch.Tensor, captured: list[torch.Tensor]) -> torch.Tensor:
        """The target's outputs for T rows -> the head's input hidden [T, H_in] for a chain's first step."""

    @abstractmethod
    def forward(self, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """hidden [T, H_in or H], token_ids/positions [T] -> the state fed to the next step [T, H]."""

    @abstractmethod
    def compute_logits(self, state: torch.Tensor) -> torch.Tensor:
        """state [N, H] -> draft logits [N, draft_vocab] fp32."""

    @abstractmethod
    def vocab_head(self) -> nn.Module:
        """The LM head compute_logits multiplies by ([draft_vocab, H])."""

    @abstractmethod
    def use_vocab_head(self, head: nn.Module) -> None:
        """compute_logits multiplies by `head` from now on (the target's own LM head is never changed)."""

    def restrict_vocab(self, ids: torch.Tensor, target_vocab: int, source: str) -> None:
        """Draft only among the target ids `ids` [N] (sorted; engine/speculative/token_map.py): the head's
        logits come from a copy of those rows of its LM head, so each draft step multiplies N rows, not V.
        A head that already drafts from a vocabulary of its own (an EAGLE-3 d2t) keeps it: an error."""
        if self.draft_vocab_size not in (None, target_vocab):
            raise ModelLoadError(f"speculative token map {source}: this head already drafts from a vocabulary of "
                                 f"its own ({self.draft_vocab_size} ids, its checkpoint's d2t); use one or the other")
        full = self.vocab_head()
        sub = LMHead(ids.numel(), full.weight.shape[1]).to(full.weight)
        sub.weight.data.copy_(full.weight.data.index_select(0, ids.to(full.weight.device)))
        self.use_vocab_head(sub)
        self.draft_vocab_size = ids.numel()
        self.register_buffer("draft_to_target", ids.to(full.weight.device), persistent=False)  # replaces EAGLE-3's

    # --------------------------------------------------------------------- loading
    def _resolve(self, name: str) -> tuple[nn.Module, str, int | None] | None:
        """A checkpoint name in HF Llama spelling (relative to this head) -> (module, leaf, shard id):
        the target's own mapping (fused q/k/v and gate/up), applied to the head's module tree."""
        return LlamaForCausalLM.param_for(self, name)


BLOCK_WEIGHTS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "post_attention_layernorm.weight")


def read_config(draft_dir: str | Path) -> dict:
    path = Path(draft_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{draft_dir} is not a draft checkpoint directory: config.json is missing")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e


def head_model_config(draft_dir: str | Path, raw: dict) -> ModelConfig:
    """The Llama-style fields of a head's config.json, read as a ModelConfig (its architectures entry
    names the head, not a causal LM, so it is parsed as Llama)."""
    from transformers import LlamaConfig

    fields = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "auto_map")}
    if "torch_dtype" in fields:  # the older spelling of `dtype`
        fields.setdefault("dtype", fields.pop("torch_dtype"))
    try:
        hf = LlamaConfig(**fields)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{draft_dir}/config.json is not a Llama-style config: {e}") from e
    arch = next((a for a in raw.get("architectures") or [] if a in SUPPORTED_ARCHITECTURES), "LlamaForCausalLM")
    return ModelConfig.from_hf(hf, arch)


def checkpoint_names(draft_dir: str | Path) -> set[str]:
    """Tensor names in a checkpoint directory, without reading the tensors."""
    names: set[str] = set()
    for f in safetensors_files(draft_dir):
        try:
            with safe_open(str(f), framework="pt") as st:
                names.update(st.keys())
        except (OSError, RuntimeError, ValueError) as e:
            raise ModelLoadError(f"cannot read weights from {f}: {e}") from e
    return names


def read_tensor(draft_dir: str | Path, name: str) -> torch.Tensor | None:
    for f in safetensors_files(draft_dir):
        with safe_open(str(f), framework="pt") as st:
            if name in st.keys():
                return st.get_tensor(name)
    return None


def check_dims(what: str, draft: ModelConfig, target: ModelConfig) -> None:
    """A head shares the target's embedding width; anything else is a checkpoint for another target."""
    if draft.hidden_size != target.hidden_size:
        raise ModelLoadError(f"{what} has hidden_size {draft.hidden_size} but the target has {target.hidden_size}")
