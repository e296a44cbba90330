"""SpecConfig: which speculative method the engine runs, with how many draft tokens per step."""
from __future__ import annotations

from dataclasses import dataclass

METHODS = ("mtp", "eagle3", "ngram", "draft_model")
MAX_K = 8


def chain_margin(k: int) -> int:
    """Positions a draft chain reaches past the KV lengths of the rows it starts from: k draft steps
    after the verified token."""
    return k + 2


def position_margin(k: int) -> int:
    """Positions past max_model_len that a step with k drafts may touch (the rope table and graph
    block tables cover them): padded verification rows (k+1) plus a chain after a full acceptance."""
    return 2 * k + 2 if k else 0


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """`LLM(model, speculative=SpecConfig(method="eagle3", k=3, draft="path/to/head"))`.

    - mtp: a DeepSeek-V3 MTP layer (`model.layers.{N}.*`, N = the target's num_hidden_layers), reused
      for all k steps. `draft` is its directory; None reads it from the target's own checkpoint.
    - eagle3: an EAGLE-3 head in its authors' layout (`LlamaForCausalLMEagle3`); `draft` required.
    - ngram: prompt lookup over the prompt and the generated tokens; no model.
    - draft_model: a separate small causal LM with the target's tokenizer; `draft` required.
    """

    method: str
    k: int = 3
    draft: str | None = None
    prompt_lookup_max: int = 4  # ngram: longest suffix n-gram tried first
    prompt_lookup_min: int = 1  # ngram: shortest suffix n-gram tried last
    # Mask the draft network's own steps with the request's grammar (or other LogitsMasker), so its
    # drafts are valid and acceptance rises; off only to measure what it gains.
    draft_masks: bool = True
    # Dynamic k: the batch sizes at which the drafts verified per request drop by one (e.g. (16, 32, 64)
    # with k=3: 3 drafts below 16 requests, 2 from 16, 1 from 32, none from 64), because past some
    # batch the verification rows cost more than the accepted drafts save. The batch is the whole
    # decode group's (under attention data parallelism every rank decides the same k from the group's
    # last agreement). Empty: always k.
    dynamic_k: tuple[int, ...] = ()
    # mtp, eagle3: a file of the target token ids the head may draft (engine/speculative/token_map.py):
    # its LM head multiplies those rows only. None: the head's whole vocabulary.
    token_map: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; use one of {METHODS}")
        if not isinstance(self.k, int) or not 1 <= self.k <= MAX_K:
            raise ValueError(f"speculative k must be an integer in [1, {MAX_K}], got {self.k!r}")
        if self.method in ("eagle3", "draft_model") and not self.draft:
            raise ValueError(f"speculative method {self.method!r} needs `draft`: the draft checkpoint directory")
        object.__setattr__(self, "dynamic_k", tuple(self.dynamic_k))
        if any(not isinstance(t, int) or t < 1 for t in self.dynamic_k) or list(self.dynamic_k) != sorted(
                set(self.dynamic_k)) or len(self.dynamic_k) > self.k:
            raise ValueError(f"dynamic_k must be at most k={self.k} increasing batch sizes >= 1, got {self.dynamic_k!r}")
        if self.token_map is not None and self.method not in ("mtp", "eagle3"):
            raise ValueError(f"a speculative token map restricts a draft head's vocabulary (mtp, eagle3), "
                             f"not {self.method!r}")
        if self.method == "ngram" and not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")

    def k_for(self, batch: int) -> int:
        """Drafts to verify per request this step, for a decode batch of `batch` requests."""
        return max(0, self.k - sum(batch >= t for t in self.dynamic_k))

    @property
    def uses_model(self) -> bool:
        """A draft network runs inside the step (everything but ngram)."""
        return self.method != "ngram"

    @property
    def lookahead_slots(self) -> int:
        """KV slots past the verified chain that the draft chain writes (a full acceptance moves the
        chain's start k positions further)."""
        return self.k if self.uses_model else 0

    @staticmethod
    def coerce(value: "SpecConfig | dict | None") -> "SpecConfig | None":
        if value is None or isinstance(value, SpecConfig):
            return value
        if isinstance(value, dict):
            return SpecConfig(**value)
        raise TypeError(f"speculative must be a SpecConfig or a dict, got {type(value).__name__}")
