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

Acceptance is counted as vLLM does: a "draft" is one sequence-step that verified drafts; mean acceptance length =
1 + accepted tokens / drafts; per-position acceptance i = (drafts whose position i was accepted) / drafts.
"""
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from drafter_client.client import DrafterClient, ProposeResult, SequenceStep
from drafter_client.engine.target import TargetModel
from drafter_client.engine.verify import sample, verify_greedy, verify_sampling


@dataclass
class SpecConfig:
    max_new_tokens: int = 64
    num_drafts: int = 3  # k, drafts asked per sequence per step
    temperature: float = 0.0  # 0: greedy; > 0: speculative sampling (plain sampling in generate_plain)
    seed: int = 0  # the engine's sampling generator
    eos_token_id: int | None = None  # a sequence stops after emitting it (kept in the output)


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

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

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

    @property
    def n(self) -> int:  # position of the pending token = tokens the target holds in its cache
        return len(self.tokens) - 1

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


class ReferenceEngine:
    _calls = itertools.count()

    def __init__(self, target: TargetModel, drafter: DrafterClient | None, info=None, use_stream: bool = True):
        """drafter None: only ``generate_plain`` works. ``info`` is the drafter's GetInfoResponse."""
        self.target = target
        self.drafter = drafter
        self.info = info
        self.use_stream = use_stream
        if drafter is not None:
            if info is None:
                raise ValueError("pass the drafter's GetInfo reply: ReferenceEngine(target, drafter, "
                                 "await drafter.get_info())")
            layers = list(info.target_layer_ids)  # EAGLE-3: the target layers the drafter reads; EAGLE-1: none
            width = target.hidden_size * max(1, len(layers))
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
        # step 0 for the drafter: the whole prompt with its hidden states, the first sampled token, k drafts
        steps = [SequenceStep(s.sequence_id, 0, s.tokens[: s.prompt_len], features[b, width - s.prompt_len:],
                              s.tokens[-1], k) for b, s in enumerate(seqs) if not s.done]
        live = self._drop_finished(seqs)
        if on_step:
            on_step(StepInfo(0, [len(s.generated) for s in seqs], {}, time.perf_counter() - t0))
        session = self.drafter.stream() if self.use_stream else None
        registered = {st.sequence_id for st in steps}  # sequences the drafter holds, until released
        draft_wait_s = 0.0
        try:
            while live:
                t_ask = time.perf_counter()
                reply = await (session.propose(steps) if session else self.drafter.propose(steps))
                draft_wait_s += time.perf_counter() - t_ask
                drafts = self._drafts(reply, live)
                # one target forward over [pending token, drafts] for every live sequence
                tokens = torch.tensor([[s.tokens[-1]] + d.tolist() + [s.tokens[-1]] * (k - d.numel())
                                       for s, d in zip(live, drafts)])
                positions = torch.stack([torch.arange(s.n, s.n + k + 1) for s in live])
                fwd = self.target.extend(tokens, positions)
                all_logits = fwd.logits.cpu()  # verification runs on the host, against the drafts from the reply
                forwards += 1
                valid = torch.zeros(len(live), k + 1, dtype=torch.bool)
                steps, accepted = [], {}
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
                    accepted[s.index] = a
                    n = s.n
                    s.tokens += new
                    self._finish(s, cfg)
                    if not s.done:
                        stats.accepted_sent_back += a
                        steps.append(SequenceStep(s.sequence_id, n, s.tokens[n : n + a + 1],
                                                  fwd.features[r, : a + 1], s.tokens[-1], k))
                self.target.keep(valid)
                stats.drafter_counted_accepted += sum(r.accepted_drafts for r in reply.sequences)
                finished = [s.sequence_id for s in live if s.done]
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
        return GenerationResult([s.generated for s in seqs], time.perf_counter() - t0, forwards, stats, draft_wait_s)

    @staticmethod
    def _drafts(reply: ProposeResult, live: list[_Seq]) -> list[torch.Tensor]:
        if len(reply.sequences) != len(live):
            raise RuntimeError(f"the drafter answered {len(reply.sequences)} sequences for {len(live)} asked")
        out = []
        for s, res in zip(live, reply.sequences):
            if res.sequence_id != s.sequence_id:
                raise RuntimeError(f"the drafter answered {res.sequence_id!r} where {s.sequence_id!r} was asked")
            if not res.ok:
                raise RuntimeError(f"the drafter refused sequence {s.sequence_id!r} at position {s.n}: "
                                   f"code {res.code}: {res.message}")
            out.append(res.drafts)
        return out
