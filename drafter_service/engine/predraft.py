"""Pre-drafting: the next step's drafts prepared while the engine verifies this step's (docs/predraft.md).

After the drafter answers a step of a sequence with drafts D_1..D_k (the sequence's committed length is then C, its
next token x[C]), the engine verifies them. The outcome is (a, b): a drafts accepted and the target's bonus token b
at position C+a+1; the next step then brings x[C], D_1..D_a (m = a+1 tokens from position C) and next_token b.
While the engine verifies, the step thread, idle otherwise, prepares that next step's drafts for the likely outcomes:

  forced pass   one batch over the sequences to prepare, eager:
    first step  the rows the drafter has not written with the target's states yet (after a hit: the hit step's
                rows [p, C)), else the row C-1 alone, again, without a KV write (its KV is there already):
                the head output g_0 and the logits L_0 at row C-1 (the distribution of x[C+1]).
    decode j    j = 1..k: the row at position C-1+j with input (D_j, g_{j-1}), as the plain decode step ran it with
                the drafts it sampled: scratch KV at C-1+j, the head output g_j, the logits L_j (after D_j).
  outcomes      for a = 0..k, F_a bonus candidates b: the most likely tokens under L_a, the served draft D_{a+1}
                excluded (a < k: the target rejected it). fan_out() spreads the sequence's budget F over a.
  branch pass   one batch over every branch of every sequence. Branch (a, b) is the next step as if the engine had
                sent it, the drafter's own features g standing in for the target states it does not know yet: a
                first row at position C+a with input (b, g_a), then k-1 decode rows; its k drafts answer the next
                step on a hit. A branch sees the sequence's KV below C+a (real below C, the forced pass's scratch
                from C) through its own block table: the sequence's blocks before the one holding C+a, a private
                copy of that block (copy on write: one block per branch, never the context) and private blocks after
                it. Greedy branches replay the decode CUDA graphs when there are some (cuda_graphs.py). The
                private blocks go back to the pool when the branch pass ends: a hit is answered from the drafts
                on the host, and nothing reads a branch's KV again.

At the next step, a hit (start position C, tokens x[C], D_1..D_a and next token b of a prepared branch, the same k and
sampling settings) is answered from the branch at once, with no device work; the hit step's rows then wait, with
their target states, for the next pass's first step ("pending"), or are prepended to the sequence's next step if that
comes first. A miss runs as a plain step. Either way the sequence's branches are freed at that step.

The pass runs on the step thread only when no request is queued, and stops between two forwards as soon as one is
(should_stop), with at most two forwards in flight on the device: a real step waits at most for those. The group
(sequences of one k) it stops in keeps no branch (groups finished before the stop keep theirs), and the next 2^n
steps (n stopped passes in a row, n <= 5) prepare nothing. A pass is not even
started when its expected time (the average of earlier passes over as many sequences, by powers of two) exceeds
FIT_SHARE of the average idle window between a batch and the next request (the scheduler reports it): a drafter
too busy to prepare falls back to plain drafting by itself, and tries again now and then: after PROBE_AFTER_SKIPS
skips in a row a pass of that size runs once anyway and its time (twice its time when stopped) replaces the
estimate (one set by a slow pass, the first one compiling kernels or one a request stopped, would otherwise keep
passes off for good). While passes do not
fit, a plain step keeps nothing for one either (worth_preparing): the step costs what it costs with pre-drafting
off. A pass's
branches take at most BRANCH_POOL_SHARE of the KV pool while it runs, and only free blocks. With
--predraft-cycle-check (off by default) passes run only while they shorten the engine's step cycle
(predraft_cycle.py: turns with and without passes, measured on the arrivals of one engine's requests): where they
make the engine slower (a GPU shared with the target, a large batch whose requests mostly wait for a miss anyway)
pre-drafting turns itself off, and tries again after a back-off. On by default, the odds check (predraft_odds.py):
a step batch is answered when its last sequence is, so only a batch whose pre-drafting sequences are all likely to
hit (h^n >= --predraft-min-all-hit for n sequences and the measured per-sequence hit rate h) keeps what a pass needs;
large batches fall back to plain drafting by themselves.

Sequential heads only (EAGLE-1, EAGLE-3), whose next_hidden is their output (so L_j = compute_logits(g_j)); parallel
and multi-layer heads ignore predraft_branches (GetInfo.predraft_supported is false).
"""
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Callable

import torch

from drafter_kernels import ops

from drafter_client.protocol.gil_yield import GilYield
from drafter_service.engine.predraft_cycle import CycleCheck
from drafter_service.engine.predraft_odds import OddsCheck
from drafter_service.engine.sampling import SamplingSettings, seed_to_int64
from drafter_service.engine.sequence import Sequence
from drafter_service.engine.step_io import StepInput, StepOutput
from drafter_service.engine.step_metadata import build_step_metadata
from drafter_service.models.attention_metadata import AttentionMetadata

MAX_PREDRAFT_BRANCHES = 64  # largest budget per sequence (GetInfo.max_predraft_branches)
BRANCH_POOL_SHARE = 0.25  # a pass's branches take at most this share of the KV pool's blocks (until it ends)
MAX_BACKOFF_EXPONENT = 5  # after n stopped passes in a row, 2^min(n, 5) steps prepare nothing
# a pass starts only when its expected time is at most this share of the expected idle window (one that fills the
# whole window on average outlasts it half of the time, and then delays the next step)
FIT_SHARE = 0.8
EMA = 0.2  # weight of the newest observation in the idle-window and pass-time averages
PROBE_AFTER_SKIPS = 16  # a pass size skipped this many times in a row runs once anyway, to measure itself again
IN_FLIGHT = 2  # forwards a pass may have queued on the device at once
# The acceptance-rate estimate of a sequence starts at 0.7, as if it had seen 2.8 accepted and 1.2 rejected drafts.
PRIOR_ACCEPTED, PRIOR_REJECTED = 2.8, 1.2


def fan_out(budget: int, k: int, alpha: float) -> list[int]:
    """Branches per accepted count a = 0..k for a budget of branches: budget * P(a) with the geometric acceptance
    P(a) = alpha^a (1 - alpha) for a < k and alpha^k for a = k (alpha: the chance that a draft is accepted given
    that the ones before it were), rounded by largest remainder so that they add up to the budget."""
    p = [alpha ** a * (1.0 - alpha) for a in range(k)] + [alpha ** k]
    raw = [budget * x for x in p]
    n = [int(r) for r in raw]
    by_remainder = sorted(range(k + 1), key=lambda a: raw[a] - n[a], reverse=True)
    for a in by_remainder[: budget - sum(n)]:
        n[a] += 1
    return n


@dataclass
class Basis:
    """The step just answered, which the next pass prepares from."""

    start: int  # position of the first row to run
    token_ids: torch.Tensor  # [r] int64: x[start .. C-1]
    hidden_states: torch.Tensor  # [r, W] their target states (a private copy)
    next_token: int  # x[C]
    drafts: list[int]  # D_1..D_k as served (target vocabulary)
    pending: bool  # True: the rows' KV is not written yet (a hit answered without running them)
    # [k, H] the head's outputs g_0..g_{k-1} of the plain step that served the drafts, when its eager loop kept them
    # (then the forced pass only runs the row of D_k); None: the forced pass runs in full
    features: torch.Tensor | None = None

    @property
    def end(self) -> int:
        """C: the committed length after the step."""
        return self.start + self.token_ids.shape[0]


@dataclass
class Branches:
    """A sequence's prepared next steps, one per outcome (a, b)."""

    base: int  # C
    next_token: int  # x[C]
    served: list[int]  # D_1..D_k
    num_drafts: int  # k
    outcomes: dict[tuple[int, int], int]  # (a, b) -> branch row
    drafts: list[list[int]]  # [branches][k] target ids
    logprobs: list[list[float]] | None  # when the sequence asked for them
    top_ids: list[torch.Tensor] | None  # [k, N] per branch, when it asked for N > 0
    top_probs: list[torch.Tensor] | None


@dataclass
class PredraftState:
    """One sequence's pre-drafting: what it asked for, what to prepare from, what is prepared."""

    budget: int  # branches asked for (SequenceStep.predraft_branches)
    num_drafts: int  # k of the step that asked
    sampling: tuple  # (temperature, seed, return_logprobs, top_k_probs) of that step: a hit needs the same
    basis: Basis | None = None
    branches: Branches | None = None
    accepted: float = PRIOR_ACCEPTED  # drafts accepted ...
    rejected: float = PRIOR_REJECTED  # ... and steps that rejected one, for the acceptance-rate estimate

    @property
    def alpha(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


@dataclass
class PredraftCounters:
    """Plain counters of the step thread, exported by the metrics (never reset)."""

    hits: int = 0  # steps answered from a prepared branch
    misses: int = 0  # steps of a sequence with branches whose outcome none of them had
    unprepared: int = 0  # steps of a pre-drafting sequence that found nothing prepared
    branches_prepared: int = 0
    passes: int = 0  # preparation passes that finished, with at least one group of sequences prepared
    passes_stopped: int = 0  # passes stopped by a real request
    passes_skipped: int = 0  # batches of a pass (one per k) not started: expected to outlast the idle window
    pass_seconds: float = 0.0  # step-thread time in passes, finished or stopped
    short_forced_passes: int = 0  # groups whose forced pass reused the plain step's features (one row each)
    refused_by_odds: int = 0  # step batches that kept nothing for a pass: too unlikely to hit all (predraft_odds.py)


def _sampling_key(s: StepInput) -> tuple:
    return (s.temperature, s.seed, s.return_logprobs, s.top_k_probs)


class _InFlight:
    """Keeps at most IN_FLIGHT forwards of a pass queued on the device, and says when the pass must stop."""

    def __init__(self, device: torch.device, should_stop: Callable[[], bool]):
        self.cuda = device.type == "cuda"
        self.should_stop = should_stop
        self.events: deque = deque()
        self.yield_gil = GilYield()  # (between two event queries: gRPC requests still get the GIL)

    def launched(self) -> bool:
        """After a forward was queued: wait until fewer than IN_FLIGHT are; True when a request is waiting."""
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
            self.events.append(event)
            while len(self.events) >= IN_FLIGHT:
                if self.events[0].query():
                    self.events.popleft()
                elif self.should_stop():
                    return True
                else:
                    self.yield_gil()
        return self.should_stop()


class Predrafter:
    """The proposer's pre-drafting: admission hooks (a hit answered, branches freed, pending rows merged), and the
    preparation pass the scheduler runs when idle. Step thread only."""

    def __init__(self, proposer):
        self.proposer = proposer
        self.model = proposer.model
        self.supported = proposer.model.drafting == "sequential"
        self.counters = PredraftCounters()
        pool = proposer.kv.pool
        self.pool = pool
        self.max_branch_blocks = max(1, int(BRANCH_POOL_SHARE * pool.num_blocks))  # per pass
        self._waiting: dict[tuple[str, str], Sequence] = {}  # a basis, no branches yet: the next pass's work
        self._with_branches: dict[tuple[str, str], Sequence] = {}
        self._stopped_in_a_row = 0
        self._skip_steps = 0  # steps left before the next pass may run (back-off after stopped passes)
        # passes only while they shorten the engine's step cycle (predraft_cycle.py), checked apart for each request
        # size (bit length of its sequence count: a batch of 64 pays off or not apart from a batch of 1)
        self.cycle_check = False  # (--predraft-cycle-check: True)
        self._cycles: dict[int, CycleCheck] = {}
        # passes only for step batches likely to hit in full (predraft_odds.py; --predraft-min-all-hit)
        self.odds = OddsCheck()
        self.window_s: float | None = None  # average idle time between a batch's end and the next request
        self._pass_s: dict[int, float] = {}  # sequences' bit length -> average seconds of a pass of that size
        # sequences' bit length -> passes of that size skipped in a row (by _fits, or by after_step not keeping a basis)
        self._skips: dict[int, int] = defaultdict(int)
        self._probing: set[int] = set()  # sizes whose next pass is a probe (its time replaces the estimate)
        # the last passes: (sequences, seconds, finished, probe), for benchmarks and debugging
        self.recent_passes: deque = deque(maxlen=256)
        proposer.table.on_drop = self.forget

    # ---- at admission and after a step (proposer.step) ----

    def admit(self, a, out: StepOutput) -> bool:
        """For an admitted sequence (proposer._Admitted; out.accepted_drafts already counted), before its batch
        runs. True: a hit, answered in out, not to be run. Otherwise its branches are freed and its pending rows, if
        any, prepended to a.step."""
        seq, s = a.seq, a.step
        st: PredraftState | None = seq.predraft
        if st is None:
            if s.predraft_branches and self.supported:
                seq.predraft = PredraftState(s.predraft_branches, a.num_drafts, _sampling_key(s))
            return False
        key = (seq.namespace, seq.sequence_id)
        self._waiting.pop(key, None)
        if seq.last_drafts:  # the acceptance-rate estimate (geometric: accepted drafts, and the first rejection)
            st.accepted += out.accepted_drafts
            st.rejected += out.accepted_drafts < len(seq.last_drafts)
        br = st.branches
        row = self._hit_row(st, br, a) if br is not None else None
        if br is not None:
            self.odds.observe(row is not None)
            self.counters.hits += row is not None
            self.counters.misses += row is None
            self._free_branches(seq)
        elif st.budget:
            self.counters.unprepared += 1
        if row is not None:
            p, m = s.start_position, s.num_tokens
            out.drafts = list(br.drafts[row])
            out.logprobs = list(br.logprobs[row]) if br.logprobs is not None and s.return_logprobs else []
            if br.top_ids is not None and s.top_k_probs:
                out.top_k_ids, out.top_k_probs = br.top_ids[row], br.top_probs[row]
            out.committed_length, out.predrafted = p + m, True
            seq.committed_len = p + m
            seq.last_drafts, seq.last_drafts_base = out.drafts, p + m
            # the rows' KV is written from the target states by the next pass (or with the next step)
            st.basis = Basis(p, s.token_ids.clone(), s.hidden_states.clone(), s.next_token, out.drafts, pending=True)
            self._settings_from(st, a)
            self._waiting[key] = seq
            return True
        basis = st.basis
        if basis is not None and basis.pending and s.start_position > basis.start:
            cut = s.start_position - basis.start  # rows [basis.start, p) have no KV yet: this step runs them too
            a.step = StepInput(
                namespace=s.namespace, sequence_id=s.sequence_id, start_position=basis.start,
                token_ids=torch.cat([basis.token_ids[:cut], s.token_ids]),
                hidden_states=torch.cat([basis.hidden_states[:cut].to(s.hidden_states.device), s.hidden_states]),
                next_token=s.next_token, num_drafts=s.num_drafts, temperature=s.temperature, seed=s.seed,
                return_logprobs=s.return_logprobs, top_k_probs=s.top_k_probs, owner=s.owner,
                predraft_branches=s.predraft_branches)
        st.basis = None
        if not s.predraft_branches or not self.supported:
            seq.predraft = None
        elif self.odds.allowed:  # (after a refused batch no pass reads them: they are set at the next allowed one)
            self._settings_from(st, a)
        return False

    def after_step(self, answered: list[tuple]) -> None:
        """After a plain step the odds check allowed (proposer.step): (admitted, drafts, features or None) of each
        pre-drafting sequence it answered; their
        next pass prepares from it (features: [k, H], the step's own g_0..g_{k-1}, when it kept them). The last
        committed row of each (token and target state) is copied once for all of them."""
        answered = [(a, d, f) for a, d, f in answered if d and a.seq.predraft is not None]
        if not answered:
            return
        if not self.worth_preparing(len(answered)):  # passes of this size do not fit, or do not pay: nothing kept
            self.counters.passes_skipped += 1
            if self._passes_allowed(len(answered)):  # (a skip of the fit check: counts toward its probe)
                self._skips[len(answered).bit_length()] += 1
            for a, _, _ in answered:
                a.seq.predraft.basis = None
            return
        tokens = torch.stack([a.step.token_ids[-1] for a, _, _ in answered])  # [n] x[C-1]
        states = [a.step.hidden_states[-1] for a, _, _ in answered]
        if len({(h.device, h.dtype) for h in states}) == 1:
            hidden = torch.stack(states)  # [n, W]: one copy (the step's own tensors may be reused by the client)
            last = [hidden[i : i + 1] for i in range(len(answered))]
        else:
            last = [h[None].clone() for h in states]
        for i, (a, drafts, features) in enumerate(answered):
            s = a.step
            a.seq.predraft.basis = Basis(
                s.start_position + s.num_tokens - 1, tokens[i : i + 1], last[i], s.next_token, list(drafts),
                pending=False, features=features if features is not None and features.shape[0] == len(drafts)
                else None)
            self._waiting[(a.seq.namespace, a.seq.sequence_id)] = a.seq

    def failed(self, seq: Sequence) -> None:
        """The sequence's step failed: nothing of its pre-drafting is kept."""
        self.forget(seq)

    def on_step(self) -> None:
        """Once per real step (the back-off counts steps)."""
        if self._skip_steps:
            self._skip_steps -= 1

    def cycle_for(self, n: int) -> CycleCheck:
        """The cycle check of requests (and passes) of n sequences."""
        check = self._cycles.get(n.bit_length())
        if check is None:
            check = self._cycles[n.bit_length()] = CycleCheck()
        return check

    def _passes_allowed(self, n: int) -> bool:
        """Whether the cycle check (when on) lets passes over n sequences run."""
        return not self.cycle_check or self.cycle_for(n).passes_allowed()

    def observe_cycle(self, seconds: float, n: int) -> None:
        """One engine's pre-drafting request of n sequences arrived `seconds` after its previous request (the
        scheduler). Holds count these requests. Nothing without --predraft-cycle-check."""
        if not self.cycle_check:
            return
        check = self.cycle_for(n)
        check.on_step()
        check.observe_cycle(seconds)

    def forget(self, seq: Sequence) -> None:
        """The sequence leaves the table (released, evicted, expired), or failed: free its branches and state."""
        if seq.predraft is None:
            return
        self._free_branches(seq)
        self._waiting.pop((seq.namespace, seq.sequence_id), None)
        seq.predraft = None

    def reset(self) -> None:
        """After a pass raised: every prepared branch is dropped and passes wait for the longest back-off. The
        sequences keep their basis: a pending one (a hit answered, its rows' KV not written yet) must still reach
        the KV with the sequence's next step (admit prepends it); any other is dropped at that step."""
        for seq in list(self._with_branches.values()):
            self._free_branches(seq)
        self._waiting.clear()
        self._skip_steps = 2 ** MAX_BACKOFF_EXPONENT

    def forget_estimates(self) -> None:
        """Drop the pass-time and idle-window averages and the skip counts (after the warm-up's passes, which
        compiled kernels)."""
        self._pass_s.clear()
        self._skips.clear()
        self._probing.clear()
        self.recent_passes.clear()
        self.window_s = None
        self.odds = OddsCheck(self.odds.min_all_hit, self.odds.probe_after)

    def observe_window(self, seconds: float) -> None:
        """The scheduler's idle time between a batch's end and the next request's arrival (0: one was waiting)."""
        self.window_s = seconds if self.window_s is None else (1 - EMA) * self.window_s + EMA * seconds

    def worth_preparing(self, n: int) -> bool:
        """Whether a plain step of n pre-drafting sequences keeps what a pass needs (its last rows, its features).
        Not while passes of that size are expected to outlast the idle window (the pass would be skipped): the
        drafter then drafts plainly at no extra cost, but on the step before a probe (PROBE_AFTER_SKIPS skips in a
        row), whose pass measures itself again. Never after a step batch the odds check refused, nor while the cycle
        check keeps passes off."""
        if not self.odds.allowed or not self._passes_allowed(n):
            return False
        size = n.bit_length()
        return self._expected_to_fit(size) or self._skips[size] >= PROBE_AFTER_SKIPS

    def _expected_to_fit(self, size: int) -> bool:
        """Whether passes over sequences of this bit length are expected within FIT_SHARE of the idle window (yes
        while either is unknown: the pass measures itself)."""
        estimate = self._pass_s.get(size)
        return estimate is None or self.window_s is None or estimate <= FIT_SHARE * self.window_s

    def _fits(self, n: int) -> bool:
        """Whether a pass over n sequences is expected to end before the next request arrives."""
        size = n.bit_length()
        if self._expected_to_fit(size):
            self._skips[size] = 0
            return True
        skips = self._skips[size] + 1
        if skips > PROBE_AFTER_SKIPS:  # a probe: the pass runs and its time replaces the estimate (_timed)
            self._skips[size] = 0
            self._probing.add(size)
            return True
        self._skips[size] = skips
        return False

    def _timed(self, n: int, seconds: float, finished: bool) -> None:
        size = n.bit_length()
        old = self._pass_s.get(size)
        probe = size in self._probing
        self._probing.discard(size)
        self.recent_passes.append((n, seconds, finished, probe))
        if not finished:  # a request came before its end: it needed more than the window (twice: a guess)
            # (a probe's guess replaces the estimate: the old one may come from a pass that compiled kernels)
            self._pass_s[size] = 2 * seconds if probe or old is None else max(old, 2 * seconds)
        elif probe or old is None or seconds < old:  # down at once (an early pass may have compiled kernels) ...
            self._pass_s[size] = seconds
        else:  # ... up gradually
            self._pass_s[size] = (1 - EMA) * old + EMA * seconds

    def has_work(self) -> bool:
        """Whether a pass has something to do (not after a step batch the odds check refused: the pending rows of
        its hits, if any, then go with their sequences' next steps)."""
        return (bool(self._waiting) and self._skip_steps == 0 and self.odds.allowed
                and self.proposer.fatal is None)

    def _hit_row(self, st: PredraftState, br: Branches, a) -> int | None:
        s = a.step
        m = s.num_tokens
        if (s.start_position != br.base or m > br.num_drafts + 1 or a.num_drafts != br.num_drafts
                or _sampling_key(s) != st.sampling):
            return None
        row = br.outcomes.get((m - 1, s.next_token))
        if row is None or s.token_ids[:m].tolist() != [br.next_token] + br.served[: m - 1]:
            return None
        return row

    def _settings_from(self, st: PredraftState, a) -> None:
        st.budget, st.num_drafts, st.sampling = a.step.predraft_branches, a.num_drafts, _sampling_key(a.step)

    def _free_branches(self, seq: Sequence) -> None:
        if seq.predraft is not None:
            seq.predraft.branches = None
        self._with_branches.pop((seq.namespace, seq.sequence_id), None)

    # ---- the preparation pass (scheduler.py runs it when no request is queued) ----

    @torch.inference_mode()
    def prepare(self, should_stop: Callable[[], bool]) -> bool:
        """Prepare the branches of every sequence waiting for them, one batch per k. False when should_stop()
        stopped it (what was prepared before the stop is kept; the rest waits for the next pass)."""
        t0 = time.perf_counter()
        try:
            return self._prepare(should_stop)
        finally:
            self.counters.pass_seconds += time.perf_counter() - t0

    def _prepare(self, should_stop: Callable[[], bool]) -> bool:
        p = self.proposer
        groups: dict[int, list[Sequence]] = {}
        waiting, self._waiting = self._waiting, {}
        for seq in waiting.values():
            st = seq.predraft
            b = st.basis
            k = st.num_drafts
            # room for every branch's k drafts below max_model_len (else nothing is prepared: pending rows then run
            # with the sequence's next step)
            if b is not None and k >= 1 and b.end + 2 * k + 1 < p.max_model_len:
                groups.setdefault((k, b.features is not None), []).append(seq)
        ran = False
        for i, ((k, _), seqs) in enumerate(groups.items()):
            if not self._passes_allowed(len(seqs)) or not self._fits(len(seqs)):  # (would not pay, or
                # would delay the next step: prepare nothing this time)
                self.counters.passes_skipped += 1
                continue
            # the forced decode's scratch KV reaches position C+k-1; a sequence the pool cannot extend, or whose
            # namespace would pass its share of the pool (--namespace-pool-share), is left out
            seqs = [seq for seq in seqs if self._extend(seq, seq.predraft.basis.end + k)]
            if not seqs:
                continue
            t0 = time.perf_counter()
            ran = True
            finished = self._prepare_group(seqs, k, _InFlight(p.device, should_stop))
            self._timed(len(seqs), time.perf_counter() - t0, finished)
            if not finished:
                for later in list(groups.values())[i:]:  # not prepared: the next pass tries again
                    self._waiting.update(((s.namespace, s.sequence_id), s) for s in later if s.predraft is not None
                                         and s.predraft.branches is None)
                self.counters.passes_stopped += 1
                self._stopped_in_a_row += 1
                self._skip_steps = 2 ** min(self._stopped_in_a_row, MAX_BACKOFF_EXPONENT)
                return False
        if ran:  # (a pass whose every group was skipped is no finished pass: the back-off goes on)
            self.counters.passes += 1
            self._stopped_in_a_row = 0
        return True

    def _extend(self, seq: Sequence, positions: int) -> bool:
        """Blocks for the sequence's first `positions` positions, within the pool and its namespace's share."""
        t = self.proposer.table
        missing = t.blocks_missing(seq, positions)
        limit = t.namespace_block_limit
        if missing and limit is not None and t.namespace_blocks(seq.namespace) + missing > limit:
            return False
        return t.resize(seq, max(positions, seq.num_blocks * t.block_size))

    def _prepare_group(self, seqs: list[Sequence], k: int, flight: _InFlight) -> bool:
        # (host tensors go to the device with non_blocking=True: a blocking copy synchronizes the stream, and the pass
        # keeps IN_FLIGHT forwards queued while it polls for requests; the sources are fresh tensors nobody reuses)
        p, model = self.proposer, self.model
        dev, bs = p.device, p.block_size
        n = len(seqs)
        states: list[PredraftState] = [seq.predraft for seq in seqs]
        bases = [st.basis for st in states]
        temperature, seed, logprobs, top_k = zip(*(st.sampling for st in states))
        greedy = not any(temperature) and not any(logprobs) and not any(top_k)
        sp = SamplingSettings(
            temperature=torch.tensor(temperature, dtype=torch.float32).to(dev, non_blocking=True),
            seed=torch.tensor([seed_to_int64(x) for x in seed], dtype=torch.int64).to(dev, non_blocking=True),
            top_k=torch.tensor(top_k, dtype=torch.int64).to(dev, non_blocking=True), want_logprobs=any(logprobs),
            greedy_only=greedy, width=max(top_k), any_hot=any(t > 0 for t in temperature))
        # the branches of one pass fit the largest decode graph (MAX_GRAPH_BATCH rows), so that the branch pass
        # replays graphs: at large batches each sequence gets fewer branches
        graphs = p.decode_graphs
        cap = max(1, graphs.sizes[-1] // n) if graphs is not None else MAX_PREDRAFT_BRANCHES
        budgets = [min(st.budget, cap) for st in states]
        budget = max(budgets)

        C = torch.tensor([b.end for b in bases], dtype=torch.int64)  # [n]
        served = torch.tensor([b.drafts for b in bases], dtype=torch.int64)  # [n, k]
        served_dev = served.to(dev, non_blocking=True)
        if bases[0].features is not None:  # (a group either has them all or none)
            # ---- forced pass, shortened: the plain step kept g_0..g_{k-1}; only the row of D_k runs ----
            w = max(seq.num_blocks for seq in seqs)
            tables = p.table.rows.gather([seq.table_row for seq in seqs], w)  # [n, w] int32
            kept = torch.stack([b.features for b in bases])  # [n, k, H]
            meta = self._decode_meta(C - 1 + k, tables, tables.to(dev, non_blocking=True))
            out = model.forward(served_dev[:, k - 1], kept[:, k - 1], meta, p.kv_layers)
            for b in bases:
                b.features = None  # (used: a retry after a stop runs the full pass)
            self.counters.short_forced_passes += 1
            feats = torch.cat([kept, model.next_hidden(out)[:, None]], 1)  # [n, k+1, H]
            if flight.launched():
                return False
            return self._branch_outcomes(seqs, states, bases, k, budgets, budget, C, served, tables, feats, sp,
                                         greedy, flight)
        # ---- forced pass, first step: pending rows with their KV write, or row C-1 without one ----
        md = build_step_metadata(
            start_positions=[b.start for b in bases], token_ids=[b.token_ids for b in bases],
            hidden_states=[b.hidden_states for b in bases], next_tokens=[b.next_token for b in bases],
            num_drafts=[k] * n, block_tables=[seq.block_table for seq in seqs], temperatures=list(temperature),
            seeds=[seed_to_int64(x) for x in seed], top_ks=list(top_k), block_size=bs, device=dev,
            table_rows=(p.table.rows, [seq.table_row for seq in seqs]))
        rows = torch.tensor([b.token_ids.shape[0] for b in bases])
        rerun = torch.repeat_interleave(torch.tensor([not b.pending for b in bases]), rows)  # [T]
        if bool(rerun.any()):
            md.first_step.slot_mapping.masked_fill_(rerun.to(dev, non_blocking=True), ops.PADDING_SLOT_ID)
        context_cache = {} if dev.type == "cpu" else None  # (CPU attention: the first step's context, kept)
        md.first_step.context_cache = context_cache
        head_out = model.forward(md.input_ids, model.combine_hidden_states(md.hidden_states), md.first_step,
                                 p.kv_layers)
        for b in bases:  # (written: every later step on this device stream sees these rows' KV)
            b.pending = False
        g0 = model.next_hidden(head_out[md.draft_rows])  # [n, H]
        if flight.launched():
            return False

        # ---- forced pass, decode j = 1..k: the served drafts as inputs (replayed from the decode graphs when
        # there are some: the forced tokens replace the graph's argmax between replays) ----
        tables = md.host_block_tables  # [n, w] int32
        if graphs is not None and graphs.fits(n, k):
            rest = graphs.run_forced(served_dev, g0, C - 1, tables, k, between=flight.launched)
            if rest is None or flight.launched():
                return False
            feats = torch.cat([g0[:, None], rest], 1)  # [n, k+1, H]: g_0..g_k
        else:
            g = [g0]
            for j in range(1, k + 1):
                pos = C - 1 + j
                out = model.forward(served_dev[:, j - 1], g[-1],
                                    self._decode_meta(pos, tables, md.first_step.block_tables, context_cache),
                                    p.kv_layers)
                g.append(model.next_hidden(out))
                if flight.launched():
                    return False
            feats = torch.stack(g, 1)  # [n, k+1, H]
        return self._branch_outcomes(seqs, states, bases, k, budgets, budget, C, served, tables, feats, sp, greedy,
                                     flight)

    def _branch_outcomes(self, seqs, states, bases, k: int, budgets: list[int], budget: int, C: torch.Tensor,
                         served: torch.Tensor, tables: torch.Tensor, feats: torch.Tensor, sp: SamplingSettings,
                         greedy: bool, flight: _InFlight) -> bool:
        """From the features g_0..g_k ([n, k+1, H]) of the n sequences: the outcomes, the branches' block tables, the
        branch pass, and each sequence's Branches. C [n], served [n, k], tables [n, w] int32 (host)."""
        p, model = self.proposer, self.model
        dev, bs, n = p.device, p.block_size, len(seqs)
        graphs = p.decode_graphs
        # ---- outcomes: F_a candidates per a, the rejected draft excluded ----
        if flight.should_stop():
            return False
        width = min(budget + 1, model.draft_vocab_size)
        logits = model.compute_logits(feats.flatten(0, 1))  # [n*(k+1), V_draft]: L_0..L_k (next_hidden = output)
        cand = model.draft_to_target(logits.topk(width, dim=-1).indices).view(n, k + 1, width).cpu()  # syncs
        F = torch.tensor([fan_out(f, k, st.alpha) for f, st in zip(budgets, states)])  # [n, k+1]
        rejected = torch.cat([served, torch.full((n, 1), -1, dtype=torch.int64)], 1)  # [n, k+1]: D_{a+1}
        ok = cand != rejected[:, :, None]
        take = ok & (ok.cumsum(-1) <= F[:, :, None])
        si, aa, ci = take.nonzero(as_tuple=True)  # one row per branch, by sequence, then a, then likelihood
        bonus = cand[si, aa, ci]  # [nb]

        if flight.should_stop():
            return False
        # ---- branch block tables: the sequence's blocks before C+a, then private ones (copy on write) ----
        start = C[si] + aa  # [nb] position of each branch's first row
        blk0 = start // bs
        last_blk = (start + k - 1) // bs
        new_count = last_blk - blk0 + 1
        room = min(self.max_branch_blocks, self.pool.num_free)
        keep = new_count.cumsum(0) <= room  # the branches that fit, in order
        if not bool(keep.all()):
            si, aa, bonus, start, blk0, last_blk, new_count = (
                t[keep] for t in (si, aa, bonus, start, blk0, last_blk, new_count))
        nb = si.numel()
        if nb == 0:
            return True
        total = int(new_count.sum())
        blocks = self.pool.allocate(total)
        new_ids = torch.tensor(blocks, dtype=torch.int64)
        try:
            first_new = new_count.cumsum(0) - new_count  # [nb] index of each branch's first private block
            W = int(last_blk.max()) + 1
            seq_tables = torch.zeros(n, max(W, tables.shape[1]), dtype=torch.int64)
            seq_tables[:, : tables.shape[1]] = tables
            col = torch.arange(W)[None, :]
            shared = col < blk0[:, None]
            private = (col >= blk0[:, None]) & (col <= last_blk[:, None])
            branch_tables = torch.zeros(nb, W, dtype=torch.int64)
            branch_tables[shared] = seq_tables[si, :W][shared]
            branch_tables[private] = new_ids[(first_new[:, None] + col - blk0[:, None])[private]]
            cow = start % bs != 0  # the block holding the first row also holds positions before it: copy them
            if bool(cow.any()):
                src = seq_tables[si[cow], blk0[cow]].to(dev, non_blocking=True)
                dst = new_ids[first_new[cow]].to(dev, non_blocking=True)
                p.kv.kv[:, :, dst] = p.kv.kv[:, :, src]

            # ---- branch pass: k rows each, from (b, g_a) at position C+a ----
            hidden0 = feats[si.to(dev, non_blocking=True), aa.to(dev, non_blocking=True)]  # [nb, H]
            if greedy and graphs is not None and graphs.fits(nb, k):
                tokens = graphs.run_rows(bonus.to(dev, non_blocking=True), hidden0, start - 1,
                                         branch_tables.to(torch.int32), k, between=flight.launched)
                result = None if tokens is None else (tokens, None, None, None)
            else:
                result = self._branch_decode(bonus.to(dev, non_blocking=True), hidden0, start, branch_tables, si, k,
                                             sp, flight)
        finally:
            # the branches' drafts are on the host now (or the pass stopped): their blocks go back to the pool (later
            # work on the device stream comes after the pass's, so a step that takes them overwrites them in order)
            self.pool.free(blocks)
        if result is None:  # stopped
            return False
        tokens, lps, top_ids, top_probs = result  # [nb, k] host; [nb, k]; [nb, k, N]; [nb, k, N] or None

        # ---- per sequence: its branches ----
        counts = torch.bincount(si, minlength=n).tolist()
        tok_rows, aa_l, bonus_l = tokens.tolist(), aa.tolist(), bonus.tolist()
        lp_rows = lps.tolist() if lps is not None else None
        r = 0
        for i, (seq, st) in enumerate(zip(seqs, states)):
            c = counts[i]
            if c == 0:
                continue
            N = st.sampling[3]
            st.branches = Branches(
                base=int(C[i]), next_token=bases[i].next_token, served=bases[i].drafts, num_drafts=k,
                outcomes={(aa_l[r + j], bonus_l[r + j]): j for j in range(c)}, drafts=tok_rows[r : r + c],
                logprobs=lp_rows[r : r + c] if lp_rows is not None else None,
                top_ids=[top_ids[r + j, :, :N] for j in range(c)] if top_ids is not None and N else None,
                top_probs=[top_probs[r + j, :, :N] for j in range(c)] if top_ids is not None and N else None)
            self._with_branches[(seq.namespace, seq.sequence_id)] = seq
            r += c
        self.counters.branches_prepared += nb
        return True

    def _decode_meta(self, pos: torch.Tensor, tables: torch.Tensor, tables_dev: torch.Tensor,
                     context_cache: dict | None = None) -> AttentionMetadata:
        """One query row per sequence at positions pos [n] (host int64), block tables [n, w] (host, and on the
        device); context_cache: shared by the forwards of one loop over the same rows (the CPU attention keeps the
        gathered context there)."""
        dev, bs = self.proposer.device, self.proposer.block_size
        n = pos.shape[0]
        slot = tables.gather(1, (pos // bs).unsqueeze(1)).squeeze(1).to(torch.int64) * bs + pos % bs
        return AttentionMetadata(positions=pos.to(dev, non_blocking=True), slot_mapping=slot.to(dev, non_blocking=True),
                                 query_start_loc=torch.arange(n + 1, dtype=torch.int32).to(dev, non_blocking=True),
                                 seq_lens=(pos + 1).to(torch.int32).to(dev, non_blocking=True), block_tables=tables_dev,
                                 max_query_len=1, context_cache=context_cache)

    def _branch_decode(self, tok: torch.Tensor, hidden: torch.Tensor, start: torch.Tensor, tables: torch.Tensor,
                       si: torch.Tensor, k: int, sp: SamplingSettings, flight: _InFlight):
        """The eager branch pass: k rows per branch, sampled as the sequence asked (rows of sp: si). Returns host
        tensors (tokens [nb, k], logprobs [nb, k] or None, top ids / probs [nb, k, N] or None), None when stopped."""
        p, model = self.proposer, self.model
        tables_dev = tables.to(torch.int32).to(p.device, non_blocking=True)
        rows = si.tolist()
        samples = []
        context_cache = {} if p.device.type == "cpu" else None  # (CPU attention: the branches' context, kept)
        for j in range(k):
            pos = start + j
            out = model.forward(tok, hidden, self._decode_meta(pos, tables.to(torch.int32), tables_dev, context_cache),
                                p.kv_layers)
            sample = p._select(model.compute_logits(out), rows, (pos + 1).tolist(), sp)
            samples.append(sample)
            tok, hidden = sample.tokens, model.next_hidden(out)
            if flight.launched() and j < k - 1:
                return None
        tokens = torch.stack([s.tokens for s in samples], 1).cpu()
        lps = torch.stack([s.logprobs for s in samples], 1).cpu() if samples[0].logprobs is not None else None
        top_ids = top_probs = None
        if samples[0].top_ids is not None:
            top_ids = torch.stack([s.top_ids for s in samples], 1).cpu()
            top_probs = torch.stack([s.top_probs for s in samples], 1).cpu()
        return tokens, lps, top_ids, top_probs

