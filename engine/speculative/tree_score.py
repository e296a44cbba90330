"""What a draft-tree node is worth: the head's probability recalibrated online into the target's acceptance rate.

A tree's expected accepted length is the sum, over its verified nodes, of the probability that the target agrees
with every draft on the node's path (engine/speculative/tree.py). The draft head's softmax is not that probability.
For a greedy request the target accepts a candidate only if it is the target's argmax, so the head's top candidate
is accepted more often than its probability says and its siblings far less often (measured on SmolLM2 and its MTP
head: scoring by raw draft probability buys siblings where the chain's deeper top-1 drafts would have been
accepted, and the depth-8 tree accepted 4.23 tokens per step against the chain's 4.89 under a grammar). For a
sampled request the rate is different again, and it moves with the prompt mix.

So each node is scored by an estimate of P(accepted | its parent accepted) looked up by (class: the request greedy
or sampled, the node's row free or masked by a grammar; its rank among its parent's candidates; its draft
probability, in NUM_BUCKETS equal buckets), learned
from what verification saw: a node whose parent was on the accepted path was a trial, an accepted one a hit.
Counts start at a prior that equals the head's own probability (the bucket's centre, PRIOR_TRIALS pseudo-trials),
so an untrained table scores as the raw head did, and are decayed (each cell's trials capped at MAX_TRIALS, hits
scaled with them) so that the estimate follows the traffic. A grammar-forced node (probability 1) keeps score 0:
the mask makes the target accept it. The estimate never changes what is emitted (verification is the usual
lossless walk), only which nodes are verified. All of it runs on the device with fixed shapes: a lookup and a
scatter-add per step, no host sync, capturable.

One table per engine. Tensor-parallel ranks see the same rows and stay equal; attention-DP ranks add the whole
group's outcomes, gathered each step (engine/speculative/tree_step.py group_outcomes), so every rank's table is
the one a single process running every request would learn: ranks rank nodes alike, and acceptance under ADP equals
one process's.
"""
from __future__ import annotations

import torch

from kernels.tree_expand import table_cells, table_scores
from kernels.tree_outcome import log_estimates, observe

NUM_BUCKETS = 16
PRIOR_TRIALS = 8.0
MAX_TRIALS = 512.0
# 0 greedy free, 1 greedy masked, 2 sampled free, 3 sampled masked: a grammar's renormalized rows are calibrated
# unlike free ones (measured on SmolLM2's MTP head: a table learned on unguided prompts first cost a guided depth-8
# tree 0.25 tokens per step against one learned on guided prompts alone)
CLASSES = 4


class AcceptanceTable:
    """Acceptance estimates [CLASSES, topk, NUM_BUCKETS] with their counts, on `device`."""

    def __init__(self, topk: int, device: torch.device):
        centre = (torch.arange(NUM_BUCKETS, dtype=torch.float32, device=device) + 0.5) / NUM_BUCKETS
        self.trials = torch.full((CLASSES, topk, NUM_BUCKETS), PRIOR_TRIALS, device=device)
        self.hits = (centre * PRIOR_TRIALS).expand(CLASSES, topk, NUM_BUCKETS).contiguous()
        self.log_rate = log_estimates(self.trials.view(-1), self.hits.view(-1))
        self.topk = topk

    def cells(self, log_probs: torch.Tensor, rank: torch.Tensor, sampled: torch.Tensor,
              masked: torch.Tensor) -> torch.Tensor:
        """log_probs [B, ...] of candidates, rank broadcastable to it (0: a parent's best), sampled [B] bool,
        masked bool broadcastable to it (the candidate's row was masked by a grammar) -> the flat cell index of each
        candidate; -1 for a forced one (probability 1) or one the grammar refused (-inf): neither is estimated,
        and a forced token's certain acceptance must not inflate the top bucket."""
        return table_cells(log_probs, rank, sampled, masked, self.topk, NUM_BUCKETS)

    def load(self, trials: torch.Tensor, hits: torch.Tensor) -> None:
        """Set the counts [CLASSES, topk, NUM_BUCKETS] (a table learned elsewhere), its log-estimates with them."""
        self.trials.copy_(trials)
        self.hits.copy_(hits)
        self.log_rate.copy_(log_estimates(self.trials.view(-1), self.hits.view(-1)))

    def log_rates(self) -> torch.Tensor:
        """[CLASSES * topk * NUM_BUCKETS] the log of each cell's estimate, flat by cell index: what an expansion
        looks its candidates up in (kernels/tree_expand.py), kept current by `observe` (no op of its own)."""
        return self.log_rate

    def score(self, log_probs: torch.Tensor, cells: torch.Tensor) -> torch.Tensor:
        """The log of each candidate's estimated acceptance rate: -inf stays -inf (the grammar refused it or the
        row is closed), probability 1 stays 0 (a forced token)."""
        return table_scores(log_probs, cells, self.log_rates())

    def observe(self, cells: torch.Tensor, reached: torch.Tensor, accepted: torch.Tensor) -> None:
        """One verification's outcome: cells [...] int64 (-1: not scored, e.g. a tree received by hand-over),
        reached [...] bool (its parent was accepted), accepted [...] bool. One launch on a GPU
        (kernels/tree_outcome.py)."""
        observe(self.trials.view(-1), self.hits.view(-1), self.log_rate, cells, reached, accepted, MAX_TRIALS)

    def rates(self) -> torch.Tensor:
        """[CLASSES, topk, NUM_BUCKETS] the current estimates (for benchmarks and tests); class 2 * sampled +
        masked."""
        return self.hits / self.trials
