"""Reference engine: speculative decoding with a Hugging Face target and the drafter sidecar, batched.

    target = TargetModel.load("models/target")
    async with DrafterClient("unix:/tmp/drafter.sock", namespace="ref") as drafter:
        engine = ReferenceEngine(target, drafter, await drafter.get_info())
        result = await engine.generate(prompts, SpecConfig(num_drafts=3, max_new_tokens=64))
        baseline = await engine.generate_plain(prompts, SpecConfig(max_new_tokens=64))

One engine step, for all live sequences at once (``generate``):
  1. the drafter's reply holds k drafts per sequence (from the previous request);
  2. one target forward over [x_n, d_1..d_k] per sequence, on the target's KV cache (``target.py``);
  3. verification per sequence (``verify.py``): greedy, or speculative sampling at temperature > 0; the target's
     slots of rejected drafts become holes;
  4. one drafter request for the batch: per sequence the committed tokens x_n, d_1..d_a with their target hidden
     states, the new pending token as ``next_token``, and k -> the next drafts.
Prefill is the same with the whole prompt (step 0 of every sequence). Finished sequences (max_new_tokens or eos)
leave the batch and are released from the drafter.

A sick drafter never changes the text, only the speed (docs/protocol.md, "When the drafter is sick"): a sequence
the drafter gave no drafts (a fallback result: the drafter did not answer in time, failed, or the client's circuit
breaker is open; or a per-sequence status) is verified with none, i.e. decoded plainly for that step. Each sequence
keeps its committed tokens and their target hidden states; its next drafter step starts where the drafter last
confirmed (``committed_length`` of its last good answer), so the steps it missed are sent again, and from position
0 when the answer says ``needs_resync`` (the drafter restarted, evicted the sequence, or missed steps). With
``keep_states=False`` (an engine that keeps only the latest step's states) a sequence that needs a resync stops
drafting and is decoded plainly to its end.

Acceptance is counted as vLLM does: a "draft" is one sequence-step that verified drafts; mean acceptance length =
1 + accepted tokens / drafts; per-position acceptance i = (drafts whose position i was accepted) / drafts.
"""
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from drafter_client.client import DrafterClient, ProposeResult, SequenceStep
from drafter_client.engine_fc import EngineFc
from drafter_client.engine.target import TargetModel
from drafter_client.engine.verify import sample, verify_greedy, verify_sampling


@dataclass
class SpecConfig:
    max_new_tokens: int = 64
    num_drafts: int = 3  # k, drafts asked per sequence per step
    temperature: float = 0.0  # 0: greedy; > 0: speculative sampling (plain sampling in generate_plain)
    seed: int = 0  # the engine's sampling generator
    eos_token_id: int | None = None  # a sequence stops after emitting it (kept in the output)
    # > 0: the drafter prepares each sequence's next drafts for up to this many verification outcomes while the
    # target verifies (docs/predraft.md); a step whose outcome was prepared is answered without drafting
    predraft_branches: int = 0


@dataclass
class AcceptanceStats:
    num_drafts: int = 0  # sequence-steps that verified drafts (vLLM's num_drafts)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [k]
    # Cross-check with the drafter, which counts acceptance itself when the committed tokens come back: the engine's
    # count over the steps it sent back (not the last step of a finished sequence) and the drafter's count.
    accepted_sent_back: int = 0
    drafter_counted_accepted: int = 0
    # the drafter's health (a fault-free run has all three 0)
    fallback_steps: int = 0  # drafter requests answered "no drafts" as a whole (ProposeResult.fallback)
    resyncs: int = 0  # sequences sent again from position 0 (needs_resync, with keep_states)
    stopped_drafting: int = 0  # sequences decoded plainly to their end (needs_resync, without keep_states)
    # pre-drafting: sequence-steps the drafter answered (with drafts), those answered from prepared drafts, and the
    # acceptance of the drafts those gave (the acceptance length of served branches)
    answered_steps: int = 0
    predrafted_steps: int = 0
    predrafted_drafts: int = 0  # of num_drafts: drafts (sequence-steps) verified that came from prepared branches
    predrafted_accepted_tokens: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def predraft_hit_rate(self) -> float:
        """Answered sequence-steps served from prepared drafts (the first step of a sequence cannot be)."""
        return self.predrafted_steps / self.answered_steps if self.answered_steps else 0.0

    @property
    def predrafted_acceptance_length(self) -> float:
        return 1.0 + self.predrafted_accepted_tokens / self.predrafted_drafts if self.predrafted_drafts else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_position]

    def record(self, offered: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += offered
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_position[i] += 1


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated tokens per prompt (prompt excluded), at most max_new_tokens each
    elapsed_s: float  # wall time, prefill included
    target_forwards: int  # prefill included
    acceptance: AcceptanceStats | None  # None for plain decoding
    draft_wait_s: float = 0.0  # of elapsed_s: time spent waiting for the drafter's replies (speculative only)
    draft_waits_s: list[float] = field(default_factory=list)  # that wait, per engine step (prefill's included)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass
class StepInfo:
    """Passed to ``on_step`` after every target forward."""
    step: int  # 0 = prefill
    generated: list[int]  # tokens generated so far, per prompt
    accepted: dict[int, int]  # prompt index -> drafts accepted this step (empty for prefill / plain decoding)
    elapsed_s: float


@dataclass
class _Seq:
    index: int  # prompt index
    sequence_id: str
    tokens: list[int]  # prompt + generated; tokens[-1] is pending (sampled, not yet run through the target)
    prompt_len: int
    done: bool = False
    # the drafter's side (generate): target hidden states of committed positions as (first position, [rows, W])
    # chunks in order (all of them with keep_states, else the latest); the drafter holds x[0 .. synced-1]
    states: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    synced: int = 0
    drafting: bool = True
    resyncs_in_a_row: int = 0

    @property
    def n(self) -> int:  # position of the pending token = tokens the target holds in its cache
        return len(self.tokens) - 1

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


class ReferenceEngine:
    _calls = itertools.count()
    MAX_RESYNCS_IN_A_ROW = 3  # a sequence the drafter keeps refusing after this many resyncs stops drafting

    def __init__(self, target: TargetModel, drafter: DrafterClient | None, info=None, use_stream: bool = True,
                 keep_states: bool = True, engine_fc: EngineFc | None = None):
        """drafter None: only ``generate_plain`` works. ``info`` is the drafter's GetInfoResponse.
        use_stream: one ProposeStream for the steps (else a unary Propose each, or the client's step channel).
        keep_states: keep every sequence's committed hidden states, to send the drafter again what it missed or
        lost (False: a sequence that needs a resync stops drafting).
        engine_fc: the EAGLE-3 head's fc (EngineFc.from_head), needed when the drafter is served with
        --engine-applies-fc (info.engine_applies_fc): the target's features are sent through it."""
        self.target = target
        self.drafter = drafter
        self.info = info
        self.use_stream = use_stream
        self.keep_states = keep_states
        if drafter is not None:
            if info is None:
                raise ValueError("pass the drafter's GetInfo reply: ReferenceEngine(target, drafter, "
                                 "await drafter.get_info())")
            layers = list(info.target_layer_ids)  # EAGLE-3: the target layers the drafter reads; EAGLE-1: none
            width = target.hidden_size * max(1, len(layers))
            applies_fc = bool(getattr(info, "engine_applies_fc", False))  # (a stand-in info may lack the field)
            if applies_fc:
                if engine_fc is None:
                    raise ValueError("the drafter is served with --engine-applies-fc: pass the head's fc, "
                                     "ReferenceEngine(..., engine_fc=EngineFc.from_head(HEAD_DIR, device, dtype))")
                if engine_fc.in_features != width:
                    raise ValueError(f"engine_fc takes {engine_fc.in_features} columns; this target gives {width} "
                                     f"(hidden size {target.hidden_size}, layers {layers})")
                width = engine_fc.out_features
            target.feature_fc = engine_fc if applies_fc else None
            if info.hidden_states_width != width:
                raise ValueError(f"the drafter reads hidden states {info.hidden_states_width} wide "
                                 f"({info.hidden_states_source}); this target gives {width} "
                                 f"(hidden size {target.hidden_size}, layers {layers or 'final'})")
            if info.vocab_size != target.vocab_size:
                raise ValueError(f"the drafter's vocabulary ({info.vocab_size}) is not the target's "
                                 f"({target.vocab_size})")
            target.feature_layer_ids = layers

    def _check(self, prompts: list[list[int]], cfg: SpecConfig, speculative: bool) -> None:
        if not prompts:
            raise ValueError("no prompts")
        if cfg.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if cfg.temperature < 0:
            raise ValueError("temperature must be >= 0")
        limit = self.target.max_positions
        extra = 0
        if speculative:
            if self.drafter is None:
                raise ValueError("generate() needs a drafter; use generate_plain() without one")
            if not 1 <= cfg.num_drafts <= self.info.max_draft_tokens:
                raise ValueError(f"num_drafts must be in [1, {self.info.max_draft_tokens}] (the drafter's "
                                 f"max_draft_tokens), got {cfg.num_drafts}")
            limit = min(limit, self.info.max_model_len)
            extra = cfg.num_drafts
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if len(p) + cfg.max_new_tokens + extra > limit:
                raise ValueError(f"prompt {i}: {len(p)} tokens + max_new_tokens {cfg.max_new_tokens} + "
                                 f"{extra} drafts exceed the model length {limit}")
            if any(not 0 <= t < self.target.vocab_size for t in p):
                raise ValueError(f"prompt {i} has a token outside the vocabulary [0, {self.target.vocab_size})")

    def _finish(self, seq: _Seq, cfg: SpecConfig) -> None:
        """Trim to max_new_tokens / the first eos and mark done when either is reached."""
        gen = seq.generated
        if cfg.eos_token_id is not None and cfg.eos_token_id in gen:
            gen = gen[: gen.index(cfg.eos_token_id) + 1]
            seq.done = True
        if len(gen) >= cfg.max_new_tokens:
            gen = gen[: cfg.max_new_tokens]
            seq.done = True
        seq.tokens = seq.tokens[: seq.prompt_len] + gen

    def _prefill(self, prompts: list[list[int]], cfg: SpecConfig, generator: torch.Generator,
                 prefix: str) -> tuple[list[_Seq], torch.Tensor]:
        fwd = self.target.prefill(prompts)
        last = fwd.logits[:, -1].cpu()  # left padding: every prompt ends in the last column
        seqs = []
        for b, p in enumerate(prompts):
            seq = _Seq(b, f"{prefix}-{b}", list(p), len(p))
            seq.tokens.append(sample(last[b], cfg.temperature, generator))
            self._finish(seq, cfg)
            seqs.append(seq)
        return seqs, fwd.features

    def _drop_finished(self, live: list[_Seq]) -> list[_Seq]:
        keep = [r for r, s in enumerate(live) if not s.done]
        if len(keep) < len(live) and keep:
            self.target.select(keep)
        return [live[r] for r in keep]

    async def generate_plain(self, prompts: list[list[int]], cfg: SpecConfig,
                             on_step: Callable[[StepInfo], None] | None = None) -> GenerationResult:
        """The baseline: plain decoding of the target, one token per sequence per forward, same batching."""
        self._check(prompts, cfg, speculative=False)
        generator = torch.Generator().manual_seed(cfg.seed)
        t0 = time.perf_counter()
        seqs, _ = self._prefill(prompts, cfg, generator, "plain")
        forwards, live = 1, self._drop_finished(seqs)
        if on_step:
            on_step(StepInfo(0, [len(s.generated) for s in seqs], {}, time.perf_counter() - t0))
        while live:
            tokens = torch.tensor([[s.tokens[-1]] for s in live])
            positions = torch.tensor([[s.n] for s in live])
            logits = self.target.extend(tokens, positions).logits[:, 0].cpu()
            forwards += 1
            for r, s in enumerate(live):
                s.tokens.append(sample(logits[r], cfg.temperature, generator))
                self._finish(s, cfg)
            live = self._drop_finished(live)
            if on_step:
                on_step(StepInfo(forwards - 1, [len(s.generated) for s in seqs], {}, time.perf_counter() - t0))
        return GenerationResult([s.generated for s in seqs], time.perf_counter() - t0, forwards, None)

    async def generate(self, prompts: list[list[int]], cfg: SpecConfig,
                       on_step: Callable[[StepInfo], None] | None = None) -> GenerationResult:
        """Speculative decoding of a batch of prompts (token ids) with k = cfg.num_drafts drafts per step."""
        self._check(prompts, cfg, speculative=True)
        generator = torch.Generator().manual_seed(cfg.seed)
        k = cfg.num_drafts
        stats = AcceptanceStats(accepted_per_position=[0] * k)
        t0 = time.perf_counter()
        seqs, features = self._prefill(prompts, cfg, generator, f"ref{next(self._calls)}")
        forwards = 1
        width = features.size(1)
        for b, s in enumerate(seqs):  # the prompt's hidden states: the drafter's first step sends them
            s.states.append((0, features[b, width - s.prompt_len:].clone()))
        live = self._drop_finished(seqs)
        if on_step:
            on_step(StepInfo(0, [len(s.generated) for s in seqs], {}, time.perf_counter() - t0))
        session = self.drafter.stream() if self.use_stream else None
        registered: set[str] = set()  # sequences the drafter may hold, until released
        draft_waits: list[float] = []
        try:
            while live:
                # one drafter request: per drafting sequence, the committed tokens from where the drafter last
                # confirmed (the previous step's, normally) with their states, the pending token, k drafts
                steps = [self._drafter_step(s, k, cfg.predraft_branches) for s in live if s.drafting]
                registered.update(st.sequence_id for st in steps)
                t_ask = time.perf_counter()
                reply = None
                if steps:
                    reply = await (session.propose(steps) if session else self.drafter.propose(steps))
                draft_waits.append(time.perf_counter() - t_ask)
                drafts, stop = self._drafts(reply, steps, live, stats)
                predrafted = {r.sequence_id for r in reply.sequences if r.predrafted} if reply is not None else set()
                if stop:  # needs a resync, and its states were not kept: decoded plainly from now on
                    await self.drafter.release(stop)
                    registered.difference_update(stop)
                # one target forward over [pending token, drafts] for every live sequence
                tokens = torch.tensor([[s.tokens[-1]] + d.tolist() + [s.tokens[-1]] * (k - d.numel())
                                       for s, d in zip(live, drafts)])
                positions = torch.stack([torch.arange(s.n, s.n + k + 1) for s in live])
                fwd = self.target.extend(tokens, positions)
                all_logits = fwd.logits.cpu()  # verification runs on the host, against the drafts from the reply
                forwards += 1
                valid = torch.zeros(len(live), k + 1, dtype=torch.bool)
                accepted = {}
                for r, (s, d) in enumerate(zip(live, drafts)):
                    logits = all_logits[r, : d.numel() + 1]
                    if cfg.temperature == 0:
                        a, new = verify_greedy(logits, d)
                    else:
                        # The drafter drafts greedily (steps go with temperature 0), so q is a point mass on each
                        # draft (draft_probs=None). A sampling drafter's q [k, V], built from the reply's logprobs /
                        # top-k, goes in draft_probs.
                        a, new = verify_sampling(logits, d, cfg.temperature, generator, draft_probs=None)
                    valid[r, : a + 1] = True  # the target's slots of x_n, d_1..d_a are committed
                    if d.numel():
                        stats.record(d.numel(), a)
                        if s.sequence_id in predrafted:
                            stats.predrafted_drafts += 1
                            stats.predrafted_accepted_tokens += a
                    accepted[s.index] = a
                    n = s.n
                    chunk = (n, fwd.features[r, : a + 1].clone())  # the states of x_n, d_1..d_a
                    s.states = s.states + [chunk] if self.keep_states else [chunk]
                    s.tokens += new
                    self._finish(s, cfg)
                    if not s.done and s.drafting:
                        stats.accepted_sent_back += a
                self.target.keep(valid)
                if reply is not None:
                    stats.drafter_counted_accepted += sum(r.accepted_drafts for r in reply.sequences)
                finished = [s.sequence_id for s in live if s.done and s.sequence_id in registered]
                live = self._drop_finished(live)
                if finished:
                    await self.drafter.release(finished)
                    registered.difference_update(finished)
                if on_step:
                    on_step(StepInfo(forwards - 1, [len(s.generated) for s in seqs], accepted,
                                     time.perf_counter() - t0))
        finally:
            if session is not None:
                await session.close()
            if registered:
                await self.drafter.release(sorted(registered))
        return GenerationResult([s.generated for s in seqs], time.perf_counter() - t0, forwards, stats,
                                sum(draft_waits), draft_waits)

    def _drafter_step(self, s: _Seq, k: int, predraft_branches: int = 0) -> SequenceStep:
        """The sequence's drafter step: x[p .. n-1] with their states, the pending x[n], k drafts; p is where the
        drafter last confirmed (0 after a needs_resync), or the first position whose states are still kept."""
        p = max(s.synced, s.states[0][0])
        parts = [t[max(0, p - start):] for start, t in s.states if start + t.size(0) > p]
        hidden = parts[0] if len(parts) == 1 else torch.cat(parts)
        if hidden.size(0) != s.n - p:
            raise RuntimeError(f"sequence {s.sequence_id!r}: {hidden.size(0)} hidden states for positions {p} .. "
                               f"{s.n - 1}")
        return SequenceStep(s.sequence_id, p, s.tokens[p : s.n], hidden, s.tokens[-1], k,
                            predraft_branches=predraft_branches)

    def _drafts(self, reply: ProposeResult | None, steps: list[SequenceStep], live: list[_Seq],
                stats: AcceptanceStats) -> tuple[list[torch.Tensor], list[str]]:
        """The drafts per live sequence (empty where the drafter gave none: not asked, a fallback, a per-sequence
        status), and the ids of the sequences that stop drafting (needs_resync without kept states). Updates each
        sequence's synced position from the answer."""
        empty = torch.empty(0, dtype=torch.int64)
        if reply is None:
            return [empty] * len(live), []
        if len(reply.sequences) != len(steps):
            raise RuntimeError(f"the drafter answered {len(reply.sequences)} sequences for {len(steps)} asked")
        if reply.fallback:
            stats.fallback_steps += 1
        by_id = {}
        stop = []
        seq_of = {s.sequence_id: s for s in live}
        for st, res in zip(steps, reply.sequences):
            if res.sequence_id != st.sequence_id:
                raise RuntimeError(f"the drafter answered {res.sequence_id!r} where {st.sequence_id!r} was asked")
            s = seq_of[st.sequence_id]
            if res.ok:
                s.synced = res.committed_length
                stats.answered_steps += 1
                stats.predrafted_steps += res.predrafted
                s.resyncs_in_a_row = 0
                by_id[st.sequence_id] = res.drafts
            elif res.needs_resync:  # the drafter lacks part of this sequence: all of it again, or no more drafts
                if self.keep_states and s.resyncs_in_a_row < self.MAX_RESYNCS_IN_A_ROW:
                    s.synced = 0
                    s.resyncs_in_a_row += 1
                    stats.resyncs += 1
                else:
                    s.drafting = False
                    stats.stopped_drafting += 1
                    stop.append(s.sequence_id)
        return [by_id.get(s.sequence_id, empty) for s in live], stop
