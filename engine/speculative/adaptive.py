"""Acceptance-driven k (SpecConfig.adaptive_k): each step, how many drafts to verify and how many draft passes to
run, from a running estimate of acceptance at each draft depth and the measured cost of a draft position.

Model. A request's drafts are accepted in order: p[j] is the chance that draft j is accepted once drafts
1..j-1 were. A step verifying k drafts per request emits, per request, 1 + sum_{j<=k} prod_{i<=j} p[i]
tokens on average, and costs c(k) plain steps: a step's time at k relative to k = 0, measured. Over a batch of B
requests with expected accepted drafts G(k) (summed over them), k maximizes tokens per second, (B + G(k)) / c(k);
a tie goes to the smaller k. c(k) is a table, not a line 1 + rho * k: the first draft position costs a draft pass's
fixed part (MTP's head KV pass; on a host-bound GPU step, graph launches) that a line fitted through k = 1..K
spreads over every k (bench/results/real_spec_adaptive_cuda.md: adaptive k drafted in 90% of the steps of a
workload where no speculation was fastest).

Estimates. Acceptance is kept per grammar class of the draft (free: an unguided request; masked: a guided
request's draft that its grammar left open; forced: a draft its grammar forced, structured/forced.py) and
depth, over the rank's requests, as decayed counts on top of a prior, so a depth the engine stopped
drafting drifts back to the prior and gets tried again. Each request also keeps its own counts (free or
masked drafts), shrunk toward its class's estimate. A guided request's drafts in hand carry their classes (which
ones its grammar forced); a depth past them (a step at a larger k than the last one drafted) is forced with the
share of that depth's drafts that were, per request shrunk toward the rank's share. Without that share a guided
request whose open drafts fail stayed at k = 1 and never drafted far enough to meet the forced runs after them
(JSON's closing quotes, commas, next keys): 0.88-0.93x of k = 3 at batch 1 (bench/results/gpu_check_3_cuda.md).

Costs. The cost table comes from the step times measured at each k, per batch size (powers of two): a k with at
least MIN_OWN of its last WINDOW steps timed is their median, shrunk toward its price; a k with fewer is its price.
Prices are the start-up probe's times at this batch (engine/runner/cost_probe.py: steps of idle requests at each
batch size and k, timed before the first request; a batch between probed sizes reads the line between them),
scaled to the measured k's, so that a k never measured is priced in proportion to one that was (what the probe
misses, host work and real contexts, scales with it). Before any step is timed, the probe's own ratios.
Tensor-parallel ranks read the probe alone (Agreement). Without a probe (cost_probe off, attention data
parallelism) the prices are a line fitted through the medians, its slope shrunk toward RHO_PRIOR; before any step
is timed there, c(k) = 1 + RHO_PRIOR * k. c(k) never falls below 1 or below c(k - 1).

Exploring. Every EXPLORE_EVERY steps another k runs, up and down in turn: up for two steps (the drafts a step
verifies are the previous step's chain's, so a deeper depth is observed only on the second), down for one (it
observes no depth that k does not, only the cost of k - 1, k = 0's included; each step away from k costs the
accepted drafts of the shorter chains verified until k's chain is back, which at the top k, exploring down in every
round, was 5% of guided JSON's steps where k = 3 was best: bench/results/gpu_check_3_cuda.md). Up is the neighbour,
or, while a k above has run fewer than UNMEASURED steps at this batch bucket, the most promising of those: until then
its cost is the probe's guess, which the table keeps in proportion to the k's measured, so a guess that over-prices
the k two above would never be corrected by exploring the next one. An unmeasured k is explored every round; a
measured one the estimates put EXPLORE_MARGIN below the decided k only in one of EXPLORE_FAR rounds (exploring costs
short steps: about 3% of guided JSON's tokens at batch 1 where k = 3 wins by 16%); at k = 0, which observes
nothing, two steps at k = 1 after every EXPLORE_IDLE. Either runs only when its cost beyond the decided k's fits
EXPLORE_BUDGET (5%) of the time: where a draft costs several plain steps (large batches on a CPU), the rounds space
out; a k that could not beat no speculation even if its requests accepted half the drafts they are estimated to
miss is not explored (at batch 64 on a 2-core CPU k = 1 costs ~1.9 plain steps against GSM8K's 0.4 drafts accepted).

Agreement. The decision is integer arithmetic over fixed-point sums (vote/decide), so every rank that sees
the same votes picks the same k. Under attention data parallelism each rank's vote (its requests' G and its
measured cost table) travels in the step's all-gather (engine/distributed/data_parallel.py's RankPlan); the group
sums the gains, takes each k's largest cost over the ranks with requests, and decides the next step's k from that.
Under tensor parallelism without it every rank holds the same requests but times its own steps, so the cost
stays the prior there (no agreement to share a measurement in): rank 0's start-up probe, which every rank takes,
else the line. No torch here.
"""
from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

FREE, MASKED, FORCED = 0, 1, 2
SCALE = 1000  # fixed point of votes: gains in thousandths of a token, costs in thousandths of a plain step
PRIOR = ((0.6, 8.0), (0.6, 8.0), (0.95, 8.0))  # per class: (acceptance, weight in observations)
FORCED_SHARE_PRIOR = (0.3, 8.0)  # a guided draft forced by its grammar: (share, weight in observations)
REQUEST_PRIOR_WEIGHT = 4.0  # a request's own counts against its class's estimate
DECAY = 0.99  # per step, on the class counts (about the last 100 steps count)
RHO_PRIOR = 0.2  # a draft position's cost, in plain steps, before any step is timed
# The fitted slope counts as this many observations of a k contrast against RHO_PRIOR (n * Var(k) of the fit's
# steps is its own count): a few noisy step times on a shared machine must not send the cost to 0 and k to the top.
RHO_PRIOR_WEIGHT = 4.0
# A k's own step time counts against the line through all k's as its count of recent steps against this many.
LINE_WEIGHT = 2.0
MAX_COST = 8.0  # plain steps: a bound on a measured ratio
# A k's own step time is the median of its last WINDOW timed steps, and the line is fitted through those medians:
# one stall (a paused process, a swap, another job's burst, first calls paying one-time costs) in a decayed mean
# priced its k out for hundreds of steps (a benchmark paused with SIGSTOP: bench/results/adaptive_k_table_cpu.md).
WINDOW = 15
# A k's own median counts once it has this many recent steps: one or two may be a stall (a first call, a grammar's
# compile, another job's burst; one 3.4 s plain step among 60 ms ones priced every draft at a plain step's cost at
# batch 14: bench/results/real_spec_probe_b16_cpu.md), and a k with fewer is read from the prices.
MIN_OWN = 3
EXPLORE_EVERY = 32
# A k that has run fewer steps than this at a batch bucket is explored in every up round whatever the estimates say
# of it (its cost there is still the probe's guess, and that guess rules the table until the k's own steps count,
# MIN_OWN of them, the first after a switch verifying the shorter chain in hand): a start-up probe that priced k = 3
# at 2.27 plain steps where it cost 2.35 against k = 1's 1.70, not 1.30, kept guided JSON at k = 1 in 125 of 166
# steps, since exploring up went to k = 2 only (bench/results/adaptive_k_before_unmeasured_b1_cpu.md).
UNMEASURED = MIN_OWN + 1
# A neighbour the estimates put this far below the decided k (thousandths of its rate) is explored in one round of
# EXPLORE_FAR only: its figures stay fresh within EXPLORE_FAR * 2 * EXPLORE_EVERY steps at a quarter of the cost.
EXPLORE_MARGIN = 100
EXPLORE_FAR = 4
# At k = 0 nothing is observed, so an estimate that sent k there changes only as the class counts decay: a request
# whose first few drafts failed (SmolLM2's MTP head on a GSM8K answer's opening) stayed undrafted for ~30 steps
# (bench/results/real_spec_k_sweep_cpu.md). After this many steps at k = 0, two steps at k = 1.
EXPLORE_IDLE = 8
# Exploring spends at most this share of the decided k's time (thousandths): each step earns that much credit, in
# thousandths of a plain step, and an exploring pair runs only when the credit covers what its two steps cost beyond
# the decided k's. Where a draft is cheap this never binds (batch 1: a k = 1 step ~1.1 plain steps); where it is dear it
# spaces the pairs out: at batch 16 on a 2-core CPU a k = 1 step cost ~3.6 plain ones, and exploring it two steps in
# ten, as EXPLORE_IDLE alone would, ran adaptive k at 0.49x no speculation (bench/results/
# real_spec_bf16w_b16_adaptive_cpu.md).
EXPLORE_BUDGET = 50
# Exploring a k supposes its requests accept this share (thousandths) of the drafts the estimate says they miss: a k
# that could not beat no speculation even so is not explored (_can_pay).
EXPLORE_OPTIMISM = 500
MAX_CREDIT = 2 * round(MAX_COST) * SCALE  # above any pair's extra cost, so a dear pair still runs now and then
# A switch of k must promise this much more (thousandths): raising k pays one step whose verified drafts are
# still the old, shorter chain's, and near-ties flip on noise (bench/adaptive_k.py: k flipping between 0 and 1).
HYSTERESIS = 30


@dataclass(frozen=True, slots=True)
class Vote:
    """One rank's say in the next k: expected accepted drafts of its requests at each k = 1..K and the measured cost
    of a step at each k = 1..K relative to k = 0 (fixed point, SCALE a plain step)."""

    gain: tuple[int, ...]  # [K]
    cost: tuple[int, ...]  # [K]
    requests: int


def decide(batch: int, gain: tuple[int, ...], cost: tuple[int, ...], k_max: int, current: int | None = None) -> int:
    """The k in [0, k_max] that maximizes (batch + G(k)) / c(k), in integers (deterministic on every rank); ties go
    to the smaller k. With `current` (the k of the last step), another k only if it promises HYSTERESIS thousandths
    more."""
    def rate(k: int) -> tuple[int, int]:
        return _rate(batch, gain, cost, k)

    top = min(k_max, len(gain))
    best = _best(batch, gain, cost, range(top + 1))
    if current is not None and current != best and current <= top:
        (t, c), (ct, cc) = rate(best), rate(current)
        if t * cc * SCALE <= ct * c * (SCALE + HYSTERESIS):
            return current
    return best


def _best(batch: int, gain: tuple[int, ...], cost: tuple[int, ...], ks) -> int:
    """Of the k's `ks` (increasing), the one of the highest rate; a tie goes to the first."""
    ks = iter(ks)
    best = next(ks)
    bt, bc = _rate(batch, gain, cost, best)
    for k in ks:
        t, c = _rate(batch, gain, cost, k)
        if t * bc > bt * c:
            best, bt, bc = k, t, c
    return best


def _rate(batch: int, gain: tuple[int, ...], cost: tuple[int, ...], k: int) -> tuple[int, int]:
    """(tokens, cost) of a step at k: the rate is their ratio."""
    return (batch * SCALE + gain[k - 1], cost[k - 1]) if k else (batch * SCALE, SCALE)


def near(vote: Vote, k: int, other: int) -> bool:
    """Is `other`'s estimated rate within EXPLORE_MARGIN of k's (integers: the same answer on every rank)."""
    (t, c), (ot, oc) = (_rate(vote.requests, vote.gain, vote.cost, j) for j in (k, other))
    return ot * c * (SCALE + EXPLORE_MARGIN) >= t * oc * SCALE


def linear_cost(k: int, rho: float = RHO_PRIOR) -> tuple[int, ...]:
    """The cost table of a line 1 + rho * j, j = 1..k (fixed point): the prior."""
    return tuple(round((1 + rho * j) * SCALE) for j in range(1, k + 1))


def group_vote(votes: list[Vote]) -> Vote:
    """The group's vote: gains summed, each k's largest cost over the ranks that hold requests."""
    k = len(votes[0].gain)
    busy = [v for v in votes if v.requests] or votes
    return Vote(tuple(sum(v.gain[j] for v in votes) for j in range(k)),
                tuple(max(v.cost[j] for v in busy) for j in range(k)), sum(v.requests for v in votes))


class _RequestCounts:
    """One request's own counts per depth: its free or masked drafts tried and accepted; of its guided drafts, how
    many were seen and how many of those its grammar forced."""

    __slots__ = ("accepted", "tried", "forced", "guided")

    def __init__(self, k: int):
        self.accepted, self.tried, self.forced, self.guided = ([0.0] * k for _ in range(4))


class AcceptanceModel:
    """Per (class, depth) acceptance of one rank's requests, and per request, as decayed counts."""

    def __init__(self, k: int):
        self.k = k
        self._accepted = [[0.0] * k for _ in PRIOR]  # [class][depth]
        self._tried = [[0.0] * k for _ in PRIOR]
        self._requests: dict[str, _RequestCounts] = {}
        self._forced = [0.0] * k  # guided drafts observed at each depth: how many were forced, of how many
        self._guided = [0.0] * k

    def class_rate(self, cls: int, depth: int) -> float:
        p, w = PRIOR[cls]
        return (self._accepted[cls][depth] + p * w) / (self._tried[cls][depth] + w)

    def rate(self, request_id: str, cls: int, depth: int) -> float:
        """Draft `depth` (0-based) of a request accepted once the ones before it were."""
        base = self.class_rate(cls, depth)
        own = self._requests.get(request_id)
        if own is None or cls == FORCED:
            return base
        acc, tried = own.accepted[depth], own.tried[depth]
        return (acc + REQUEST_PRIOR_WEIGHT * base) / (tried + REQUEST_PRIOR_WEIGHT)

    def forced_share(self, request_id: str, depth: int) -> float:
        """The chance that a guided request's draft at `depth` (its earlier drafts accepted) is one its grammar
        forces: its own share shrunk toward the rank's."""
        p, w = FORCED_SHARE_PRIOR
        base = (self._forced[depth] + p * w) / (self._guided[depth] + w)
        own = self._requests.get(request_id)
        if own is None:
            return base
        return (own.forced[depth] + REQUEST_PRIOR_WEIGHT * base) / (own.guided[depth] + REQUEST_PRIOR_WEIGHT)

    def decay(self) -> None:
        for counts in (*self._accepted, *self._tried, self._forced, self._guided):
            for j in range(self.k):
                counts[j] *= DECAY

    def observe(self, request_id: str, guided: bool, num_drafts: int, accepted: int, forced_bits: int) -> None:
        """A step verified `num_drafts` drafts of a request and accepted the first `accepted`; bit j of
        forced_bits: draft j was forced by its grammar. Depths past the first rejection are not observed."""
        own = self._requests.get(request_id)
        if own is None:
            own = self._requests[request_id] = _RequestCounts(self.k)
        for j in range(min(num_drafts, accepted + 1, self.k)):
            ok = j < accepted
            forced = forced_bits >> j & 1
            cls = FORCED if forced else (MASKED if guided else FREE)
            if guided:
                self._guided[j] += 1.0
                self._forced[j] += forced
                own.guided[j] += 1.0
                own.forced[j] += forced
            self._tried[cls][j] += 1.0
            self._accepted[cls][j] += ok
            if cls != FORCED:
                own.tried[j] += 1.0
                own.accepted[j] += ok

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def gains(self, request_id: str, guided: bool, forced_bits: int, known: int | None = None) -> list[float]:
        """Expected accepted drafts of the request at k = 1..K: the classes of its first `known` drafts (those in
        hand; None: all K) from forced_bits, a guided request's later ones forced with their depth's share."""
        known = self.k if known is None else known
        out, through, total = [], 1.0, 0.0
        for j in range(self.k):
            if j < known or not guided:
                p = self.rate(request_id, FORCED if forced_bits >> j & 1 else (MASKED if guided else FREE), j)
            else:
                f = self.forced_share(request_id, j)
                p = f * self.rate(request_id, FORCED, j) + (1 - f) * self.rate(request_id, MASKED, j)
            through *= p
            total += through
            out.append(total)
        return out


class StepCost:
    """The cost table: a step's time at each k relative to k = 0, per batch size bucket (powers of two), from the
    step times measured at the k's that ran (medians, not means: see WINDOW) and the prices of the k's not measured
    lately: the start-up probe's times at this batch (engine/runner/cost_probe.py), scaled to the measured ones,
    else a line fitted through the medians."""

    def __init__(self, k: int):
        self.k = k
        self._recent: dict[int, list[deque]] = {}  # bucket -> the last WINDOW step times at each k = 0..K
        self._probe: dict[int, list[float]] = {}  # batch size -> the probe's seconds at k = 0..K

    @staticmethod
    def bucket(batch: int) -> int:
        return max(batch, 1).bit_length()

    def set_probe(self, probed: dict[int, list[float]]) -> None:
        """The start-up probe's step times, {batch size: [seconds at k = 0..K]}; a batch between two probed sizes
        reads the line between them (a bucket spans up to twice its smallest batch, and rows beyond a compiled
        bucket cost in proportion)."""
        for size, times in probed.items():
            assert len(times) == self.k + 1, (size, times)
        # a k never costs less than a smaller one (more rows, more draft passes): a noisy probe's dip is not a saving
        self._probe = {size: [max(times[: j + 1]) for j in range(len(times))] for size, times in sorted(probed.items())}

    def observe(self, batch: int, k: int, seconds: float) -> None:
        recent = self._recent.setdefault(self.bucket(batch), [deque(maxlen=WINDOW) for _ in range(self.k + 1)])
        recent[min(k, self.k)].append(seconds)

    def _fit(self, batch: int) -> tuple[float, float] | None:
        """(the line's time at k = 0, rho) through each k's median weighted by its count of recent steps; rho fitted
        where the k's seen vary, shrunk toward RHO_PRIOR. None before any step of the bucket is timed."""
        recent = self._recent.get(self.bucket(batch))
        points = [(j, statistics.median(times), len(times)) for j, times in enumerate(recent or ()) if times]
        if not points:
            return None
        n = sum(w for _, _, w in points)
        sk = sum(w * j for j, _, w in points)
        skk = sum(w * j * j for j, _, w in points)
        st = sum(w * t for _, t, w in points)
        skt = sum(w * j * t for j, t, w in points)
        rho = RHO_PRIOR
        spread = n * skk - sk * sk
        if spread >= 0.02 * n * n:  # else the k's seen vary too little (variance under 0.02): no slope to fit
            slope = (n * skt - sk * st) / spread
            intercept = (st - slope * sk) / n
            if intercept > 0:
                fitted, weight = min(max(slope / intercept, 0.0), 4.0), spread / n  # n * Var(k)
                rho = (weight * fitted + RHO_PRIOR_WEIGHT * RHO_PRIOR) / (weight + RHO_PRIOR_WEIGHT)
        return (st / n) / (1 + rho * sk / n), rho

    def rho(self, batch: int) -> float:
        """The line's slope relative to its k = 0."""
        fit = self._fit(batch)
        return RHO_PRIOR if fit is None else fit[1]

    def _probe_at(self, batch: int) -> list[float] | None:
        """The probe's step times at `batch`, between the probed sizes around it (None without a probe)."""
        if not self._probe:
            return None
        sizes = list(self._probe)
        above = next((s for s in sizes if s >= batch), sizes[-1])
        below = max((s for s in sizes if s <= batch), default=sizes[0])
        if above == below:
            return self._probe[above]
        w = (batch - below) / (above - below)
        return [(1 - w) * lo + w * hi for lo, hi in zip(self._probe[below], self._probe[above])]

    def _prices(self, batch: int) -> list[float]:
        """Each k's time relative to one another (any scale): the probe's at this batch, else the line 1 + rho k."""
        probe = self._probe_at(batch)
        if probe is not None:
            return probe
        rho = self.rho(batch)
        return [1 + rho * j for j in range(self.k + 1)]

    def probe_table(self, batch: int) -> list[float] | None:
        """c(k) for k = 1..K from the probe alone (None without a probe): what ranks that cannot share a
        measurement (tensor parallelism) all read alike."""
        probe = self._probe_at(batch)
        return None if probe is None else [min(t / probe[0], MAX_COST) for t in probe[1:]]

    def table(self, batch: int) -> list[float]:
        """c(k) for k = 1..K. A k with at least MIN_OWN recent steps is its median, shrunk toward its price by its
        count against LINE_WEIGHT; a k with fewer is its price. Prices (the probe's times at this batch, else the
        line) are scaled to the measured k's; with none measured the prices' own ratios."""
        prices = self._prices(batch)
        recent = self._recent.get(self.bucket(batch)) or [()] * (self.k + 1)
        own = [(j, statistics.median(times), len(times)) for j, times in enumerate(recent) if len(times) >= MIN_OWN]
        scale = (sum(n * m for _, m, n in own) / sum(n * prices[j] for j, _, n in own)) if own else 1.0
        est = [scale * p for p in prices]
        for j, median, n in own:
            est[j] = (n * median + LINE_WEIGHT * est[j]) / (n + LINE_WEIGHT)
        # never below a plain step nor below a smaller k (more rows, more draft passes): a dip is the noise of a
        # shared machine, and a draft priced under a plain step would be run whatever it is accepted at
        table, floor = [], 1.0
        for t in est[1:]:
            floor = min(max(t / est[0], floor), MAX_COST)
            table.append(floor)
        return table


class AdaptiveK:
    """The acceptance model and cost fit of one engine, and the k they pick each step."""

    def __init__(self, k: int, measured: bool):
        """measured: the cost table from this engine's own step times (a single engine, or ADP ranks that agree on
        it); else the prior always (TP ranks, which cannot share a measurement)."""
        self.k = k
        self.measured = measured
        self.acceptance = AcceptanceModel(k)
        self.cost = StepCost(k)
        self.steps = 0
        self.idle = 0  # consecutive steps decided at k = 0
        self.last: int | None = None  # the last decided k (before exploring), which hysteresis holds
        self._idle_second = False  # the next idle exploring step is its pair's second
        self.credit = 0  # exploring credit, thousandths of a plain step (EXPLORE_BUDGET)
        self._plan: tuple[int, bool] | None = None  # the exploring round under way: (its k, up: a second step)
        self._ran: dict[int, list[int]] = {}  # batch bucket -> steps run at each k = 0..K

    def vote(self, requests, batch: int) -> Vote:
        """This rank's vote over its decoding `requests` (engine Requests); `batch`: the group's batch, whose
        bucket the cost is read at."""
        total = [0.0] * self.k
        for req in requests:
            guided = req.params.structured_output is not None
            for j, g in enumerate(self.acceptance.gains(req.request_id, guided, req.spec_forced,
                                                        len(req.spec_token_ids))):
                total[j] += g
        table = self.cost.table(batch) if self.measured else self.cost.probe_table(batch)
        cost = linear_cost(self.k) if table is None else tuple(round(c * SCALE) for c in table)
        return Vote(tuple(round(g * SCALE) for g in total), cost, len(requests))

    def choose(self, vote: Vote, k_max: int) -> int:
        """The step's k from the (group's) vote, bounded by k_max; every EXPLORE_EVERY steps another k, in turn up
        for two steps (none at k_max) and down for one (up at 0), and two steps at k = 1 after every EXPLORE_IDLE
        decided at 0. Up is the neighbour, or the most promising k above that has not run UNMEASURED steps at this
        batch bucket; a neighbour EXPLORE_MARGIN below the decided k runs in one round of EXPLORE_FAR only (an
        unmeasured k in every round). The same steps on every rank (they count steps and decide alike)."""
        k = self._choose(vote, k_max)
        if vote.requests:  # a step of prompts alone is not timed
            bucket = StepCost.bucket(vote.requests)
            if bucket not in self._ran:
                self._ran[bucket] = [0] * (self.k + 1)
            self._ran[bucket][min(k, self.k)] += 1
        return k

    def unmeasured(self, vote: Vote, k: int) -> bool:
        """Has k run fewer than UNMEASURED steps at the vote's batch bucket (its cost is still the probe's or the
        line's guess, whatever the estimates say of it)? Counted from the decisions, so equal on every rank."""
        ran = self._ran.get(StepCost.bucket(vote.requests))
        return ran is None or ran[k] < UNMEASURED

    def _up(self, vote: Vote, k: int, k_max: int) -> int | None:
        """The k an up round explores from k: the best by the estimates of the unmeasured k's above that could pay,
        else k + 1; None at the top."""
        top = min(k_max, len(vote.gain))
        if k >= top:
            return None
        guesses = [j for j in range(k + 1, top + 1) if self.unmeasured(vote, j) and _can_pay(vote, j)]
        return _best(vote.requests, vote.gain, vote.cost, guesses) if guesses else k + 1

    def _choose(self, vote: Vote, k_max: int) -> int:
        self.steps += 1
        if self.steps % EXPLORE_EVERY == 0:
            self._plan = None  # a round's plan is made on its first step, or there is none
        self.acceptance.decay()
        k = self.last = decide(vote.requests, vote.gain, vote.cost, k_max, self.last)
        self.credit = min(self.credit + EXPLORE_BUDGET * _cost(vote, k) // SCALE, MAX_CREDIT)
        self.idle = self.idle + 1 if k == 0 else 0
        if k:
            self._idle_second = False
        if k == 0 and self.idle > EXPLORE_IDLE and k_max > 0 and _can_pay(vote, 1):
            extra = _extra(vote, 0, 1)
            if self._idle_second or self.credit >= 2 * extra:
                self.credit -= extra
                self._idle_second = not self._idle_second
                if not self._idle_second:
                    self.idle = 0
                return 1
        if self.steps % EXPLORE_EVERY < 2 and self.steps >= EXPLORE_EVERY and k_max > 0:
            rnd = self.steps // EXPLORE_EVERY
            if self.steps % EXPLORE_EVERY == 0:  # the round's first step decides for its steps
                up = k == 0 or rnd % 2 == 1
                other = self._up(vote, k, k_max) if up else k - 1
                worth = other is not None and ((rnd // 2) % EXPLORE_FAR == 1 or near(vote, k, other)
                                               or self.unmeasured(vote, other))
                affordable = worth and _can_pay(vote, other) and self.credit >= 2 * _extra(vote, k, other)
                # exploring down is one step: it times k - 1 and observes no depth that k does not
                self._plan = (other, up) if affordable else None
            plan = self._plan  # its second step only up (the first step of the next round clears it)
            if plan is not None and (plan[1] or self.steps % EXPLORE_EVERY == 0):
                other = min(plan[0], k_max)
                self.credit -= _extra(vote, k, other)
                k = other
        return k


def _cost(vote: Vote, k: int) -> int:
    """c(k) in thousandths of a plain step (c(0) = SCALE)."""
    return vote.cost[k - 1] if k else SCALE


def _can_pay(vote: Vote, k: int) -> bool:
    """Could k beat no speculation if its requests accepted EXPLORE_OPTIMISM of the drafts the estimate says they
    miss: exploring a k that could not only spends. With every draft accepted (the bound this was first), a k costing
    under k + 1 plain steps stayed worth exploring: SmolLM2 at batch 64 on a 2-core CPU, k = 1 at 1.9 plain steps and
    0.41 drafts accepted a request, explored 4-21 of ~63 steps and ran 0.84-0.91x of no speculation
    (bench/results/deferred_kv_run1_cpu.md). The estimates decay toward their priors while nothing is observed, so a
    workload that turns predictable is explored again."""
    if k == 0:
        return True
    j = min(k, len(vote.cost))
    gain = vote.gain[j - 1]
    hopeful = gain + EXPLORE_OPTIMISM * (vote.requests * j * SCALE - gain) // SCALE
    return (vote.requests * SCALE + hopeful) * SCALE > vote.requests * SCALE * _cost(vote, j)


def _extra(vote: Vote, k: int, other: int) -> int:
    """What a step at `other` costs beyond one at the decided k (never below 0: a cheaper neighbour is free)."""
    return max(_cost(vote, min(other, len(vote.cost))) - _cost(vote, k), 0)
