"""The proposer's input and output for a whole engine step as columns (the columnar form of step_io.py).

A columnar request (ProposeRequest.columns, the client's StepBatch) is decoded into one BatchInput: a handful of
tensors for all B sequences, no Python object per sequence. Proposer.step_batch runs the common step (known
sequences, sequential head, no pre-drafting, no log-probabilities or top-N) straight from these columns; any other
step goes through Proposer.step_per_sequence after BatchInput.to_inputs, and its outputs come back as a BatchOutput
that wraps them (BatchOutput.from_outputs), so every caller sees one type. Proposer.step, given StepInputs, builds a
BatchInput (from_inputs) for a step the columns path may take.

  BatchInput (host tensors unless said)
    sequence_ids      list[str]  [B]
    namespaces        list[str]  [B]   (one request has one namespace; a merged batch may hold several)
    owners            list[str | None] [B]   the stream / step channel a new sequence would belong to
    start_positions   [B] int64   p_i
    num_tokens        [B] int64   m_i >= 1
    token_ids         [T] int64   x[p_i .. p_i+m_i-1], sequence after sequence (T = sum m_i)
    hidden_states     [T, W]      the target states, wire dtype; host, or the server's device (shared memory);
                                  None in a merged batch: then state_parts holds each request's [T_j, W] states,
                                  in order (BatchInput.cat leaves them apart: states(), the step copies each to the
                                  device, a step channel's pinned mailbox view in one DMA, with no host copy)
    next_tokens       [B] int64   x[p_i+m_i]
    num_drafts        [B] int64   k_i asked for
    temperatures      [B] float32
    seeds             [B] int64   the uint64 seeds' bits
    return_logprobs   [B] bool
    top_k_probs       [B] int64
    predraft_branches [B] int64

  BatchOutput (host tensors), when the fast path produced it
    codes             [B] int32   per-sequence status (step_io's codes); messages: list[str] [B]
    drafts            [B, K] int64  row i's first num_drafts[i] entries are its drafts (target ids)
    num_drafts        [B] int64
    accepted_drafts   [B] int64
    committed_lengths [B] int64
  or, from the per-sequence path, ``outputs``: list[StepOutput] (log-probabilities, top-N, pre-drafting).

BatchInput.arrays: the host columns as numpy views (made once per batch: the columns path does its arithmetic in
numpy, where a small-array op costs about a microsecond and each torch .numpy() call about as much).
"""
import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from drafter_service.engine.sampling import int64_to_seed, seed_to_int64
from drafter_service.engine.step_io import StepInput, StepOutput


@dataclass
class BatchInput:
    sequence_ids: list[str]
    namespaces: list[str]
    owners: list[str | None]
    start_positions: torch.Tensor
    num_tokens: torch.Tensor
    token_ids: torch.Tensor
    hidden_states: torch.Tensor
    next_tokens: torch.Tensor
    num_drafts: torch.Tensor
    temperatures: torch.Tensor
    seeds: torch.Tensor
    return_logprobs: torch.Tensor
    top_k_probs: torch.Tensor
    predraft_branches: torch.Tensor
    state_parts: list[torch.Tensor] | None = None  # (a merged batch's; hidden_states is then None)

    def __len__(self) -> int:
        return len(self.sequence_ids)

    def __getattr__(self, name: str):
        """(Reached only for an attribute not set: a column of a BatchInput made by from_arrays, which makes each
        tensor from its numpy array on first use. The columns path reads the arrays alone, so a step channel's
        request that runs there never makes them: nine torch.from_numpy calls fewer in its parse.)"""
        arrays = self.__dict__.get("arrays")
        if arrays is None or name not in _LAZY_COLUMNS:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        column = torch.from_numpy(getattr(arrays, name))
        setattr(self, name, column)
        return column

    @functools.cached_property
    def arrays(self) -> "BatchArrays":
        """The host columns as numpy views of the same memory (the columns are not reassigned after construction)."""
        return BatchArrays(*(getattr(self, name).numpy() for name in BatchArrays.__dataclass_fields__))

    @property
    def total_tokens(self) -> int:
        return self.token_ids.shape[0]

    def states(self) -> list[torch.Tensor]:
        """The step's hidden states as tensors whose rows, in order, are the [T, W] states."""
        return [self.hidden_states] if self.hidden_states is not None else self.state_parts

    def set_owner(self, owner: str | None) -> None:
        self.owners = [owner] * len(self.sequence_ids)

    @classmethod
    def from_lists(cls, namespace: str, sequence_ids: list[str], start_positions: list[int], num_tokens: list[int],
                   token_ids: torch.Tensor, hidden_states: torch.Tensor, next_tokens: list[int],
                   num_drafts: list[int], temperatures: list[float], seeds: list[int], return_logprobs: list[bool],
                   top_k_probs: list[int], predraft_branches: list[int]) -> "BatchInput":
        """seeds: uint64 values (as the wire's SequenceStep carries them)."""
        B = len(sequence_ids)
        i64 = torch.int64
        return cls(sequence_ids=list(sequence_ids), namespaces=[namespace] * B, owners=[None] * B,
                   start_positions=torch.tensor(start_positions, dtype=i64),
                   num_tokens=torch.tensor(num_tokens, dtype=i64), token_ids=token_ids, hidden_states=hidden_states,
                   next_tokens=torch.tensor(next_tokens, dtype=i64), num_drafts=torch.tensor(num_drafts, dtype=i64),
                   temperatures=torch.tensor(temperatures, dtype=torch.float32),
                   seeds=torch.tensor([seed_to_int64(s) for s in seeds], dtype=i64),
                   return_logprobs=torch.tensor(return_logprobs, dtype=torch.bool),
                   top_k_probs=torch.tensor(top_k_probs, dtype=i64),
                   predraft_branches=torch.tensor(predraft_branches, dtype=i64))

    @classmethod
    def from_inputs(cls, steps: list[StepInput]) -> "BatchInput":
        """The same steps as columns (Proposer.step hands a batch that step_batch's columns path may take there): the
        scalar fields read in one pass into numpy columns (from_arrays: no torch op per column), the states left
        each step's own tensor (state_parts; the step copies them to the device as one block where they are
        consecutive rows of one tensor, else through one pinned concatenation: host_staging.rows_into)."""
        # [6, B] int64, each row one contiguous column
        ints = np.array([(s.start_position, s.token_ids.shape[0], s.next_token, s.num_drafts, s.top_k_probs,
                          s.predraft_branches) for s in steps], dtype=np.int64).reshape(len(steps), 6).T.copy()
        try:  # (the uint64 seeds' bits as int64, vectorized; a seed outside uint64 goes through seed_to_int64)
            seeds = np.array([s.seed for s in steps], dtype=np.uint64).view(np.int64)
        except OverflowError:
            seeds = np.array([seed_to_int64(s.seed) for s in steps], dtype=np.int64)
        token_ids = torch.cat([s.token_ids for s in steps]).to(torch.int64)  # (int64 already: no copy)
        arrays = BatchArrays(start_positions=ints[0], num_tokens=ints[1], token_ids=token_ids.numpy(),
                             next_tokens=ints[2], num_drafts=ints[3],
                             temperatures=np.array([s.temperature for s in steps], dtype=np.float32), seeds=seeds,
                             return_logprobs=np.array([s.return_logprobs for s in steps], dtype=np.bool_),
                             top_k_probs=ints[4], predraft_branches=ints[5])
        b = cls.from_arrays(steps[0].namespace, [s.sequence_id for s in steps], arrays, token_ids, None)
        b.namespaces, b.owners = [s.namespace for s in steps], [s.owner for s in steps]
        b.state_parts = [s.hidden_states for s in steps]
        return b

    @classmethod
    def from_arrays(cls, namespace: str, sequence_ids: list[str], arrays: "BatchArrays", token_ids: torch.Tensor,
                    hidden_states: torch.Tensor) -> "BatchInput":
        """The columns given as numpy arrays of their own (arrays.token_ids: token_ids' memory): tensors over the
        same memory, each made on first use (__getattr__), and ``arrays`` kept as BatchInput.arrays (no conversion
        back)."""
        n = len(sequence_ids)
        b = cls.__new__(cls)  # (not __init__: the other columns are made from the arrays when first read)
        b.sequence_ids, b.namespaces, b.owners = sequence_ids, [namespace] * n, [None] * n
        b.token_ids, b.hidden_states, b.state_parts = token_ids, hidden_states, None
        b.__dict__["arrays"] = arrays  # (functools.cached_property's slot: the arrays are these tensors' memory)
        return b

    @classmethod
    def cat(cls, parts: "list[BatchInput]") -> "BatchInput":
        """One batch of several requests' sequences, in order (the scheduler merges requests so)."""
        if len(parts) == 1:
            return parts[0]
        joined = lambda name: torch.cat([getattr(b, name) for b in parts])  # noqa: E731
        # the states stay each request's own tensor (a host cat of a merged EAGLE-3 batch of 4 x 32 sequences was
        # 0.7-0.9 ms on the dev CPU, and a step channel's pinned mailbox view lost its one-DMA path in it)
        return cls(sequence_ids=[s for b in parts for s in b.sequence_ids],
                   namespaces=[n for b in parts for n in b.namespaces], owners=[o for b in parts for o in b.owners],
                   start_positions=joined("start_positions"), num_tokens=joined("num_tokens"),
                   token_ids=joined("token_ids"), hidden_states=None, next_tokens=joined("next_tokens"),
                   num_drafts=joined("num_drafts"), temperatures=joined("temperatures"), seeds=joined("seeds"),
                   return_logprobs=joined("return_logprobs"), top_k_probs=joined("top_k_probs"),
                   predraft_branches=joined("predraft_branches"), state_parts=[t for b in parts for t in b.states()])

    def take(self, keep: np.ndarray) -> "BatchInput":
        """The sequences keep ([n] int64 indices into the batch, in order) as a batch of their own, their columns and
        token ids, without hidden states (the drafter's rehearsal of a step some of whose sequences are gone since:
        Proposer.rehearse_columns)."""
        a = self.arrays
        m = a.num_tokens
        kept = m[keep]
        # token row r of the new batch is row (its sequence's first row here) + (r - its first row there)
        first_here, first_there = np.cumsum(m)[keep] - kept, np.cumsum(kept) - kept
        rows = np.repeat(first_here - first_there, kept) + np.arange(int(kept.sum()))
        arrays = BatchArrays(**{name: (a.token_ids[rows] if name == "token_ids" else getattr(a, name)[keep])
                                for name in BatchArrays.__dataclass_fields__})
        keep = keep.tolist()
        b = BatchInput.from_arrays(self.namespaces[keep[0]] if keep else "", [self.sequence_ids[i] for i in keep],
                                   arrays, torch.from_numpy(arrays.token_ids), None)
        b.namespaces, b.owners = [self.namespaces[i] for i in keep], [self.owners[i] for i in keep]
        return b

    def to_inputs(self) -> list[StepInput]:
        """The same steps, one StepInput per sequence (Proposer.step's form)."""
        ms = self.num_tokens.tolist()
        if len(ms) == 1 and self.hidden_states is not None:
            per_step = [(self.token_ids, self.hidden_states)]
        else:
            per_step = zip(self.token_ids.split(ms), _rows_split(self.states(), ms))
        seeds = [int64_to_seed(s) for s in self.seeds.tolist()]
        return [StepInput(namespace=ns, sequence_id=sid, start_position=p, token_ids=tok, hidden_states=hid,
                          next_token=nxt, num_drafts=k, temperature=t, seed=seed, return_logprobs=lp, top_k_probs=n,
                          owner=owner, predraft_branches=f)
                for sid, ns, owner, p, nxt, k, t, seed, lp, n, f, (tok, hid)
                in zip(self.sequence_ids, self.namespaces, self.owners, self.start_positions.tolist(),
                       self.next_tokens.tolist(), self.num_drafts.tolist(), self.temperatures.tolist(), seeds,
                       self.return_logprobs.tolist(), self.top_k_probs.tolist(), self.predraft_branches.tolist(),
                       per_step)]


def _rows_split(parts: list[torch.Tensor], counts: list[int]) -> list[torch.Tensor]:
    """The rows of parts, in order, cut into pieces of counts[i] rows: views of the parts where no piece spans two
    of them (each part is whole sequences: one request's states), else of their concatenation."""
    if len(parts) == 1:
        return list(parts[0].split(counts))
    pieces, at = [], 0
    for part in parts:
        n, take = part.shape[0], []
        while n > 0 and at < len(counts):
            take.append(counts[at])
            n -= counts[at]
            at += 1
        if n != 0:
            return list(torch.cat(parts).split(counts))
        pieces.extend(part.split(take))
    return pieces


@dataclass
class BatchArrays:
    """BatchInput's host columns as numpy views (BatchInput.arrays)."""

    start_positions: np.ndarray
    num_tokens: np.ndarray
    token_ids: np.ndarray
    next_tokens: np.ndarray
    num_drafts: np.ndarray
    temperatures: np.ndarray
    seeds: np.ndarray
    return_logprobs: np.ndarray
    top_k_probs: np.ndarray
    predraft_branches: np.ndarray


# BatchInput's tensor columns that from_arrays leaves to be made on first use (BatchInput.__getattr__)
_LAZY_COLUMNS = frozenset(name for name in BatchArrays.__dataclass_fields__ if name != "token_ids")


@dataclass
class BatchOutput:
    codes: torch.Tensor | None = None  # [B] int32
    messages: list[str] = field(default_factory=list)
    drafts: torch.Tensor | None = None  # [B, K] int64
    num_drafts: torch.Tensor | None = None  # [B] int64
    accepted_drafts: torch.Tensor | None = None  # [B] int64
    committed_lengths: torch.Tensor | None = None  # [B] int64
    outputs: list[StepOutput] | None = None  # the per-sequence path's outputs (then the fields above are None)

    def __len__(self) -> int:
        return len(self.outputs) if self.outputs is not None else len(self.messages)

    @classmethod
    def from_outputs(cls, outputs: list[StepOutput]) -> "BatchOutput":
        return cls(outputs=outputs)

    @classmethod
    def failed(cls, batch_size: int, code: int, message: str) -> "BatchOutput":
        zeros = torch.zeros(batch_size, dtype=torch.int64)
        return cls(codes=torch.full((batch_size,), code, dtype=torch.int32), messages=[message] * batch_size,
                   drafts=torch.zeros(batch_size, 0, dtype=torch.int64), num_drafts=zeros, accepted_drafts=zeros,
                   committed_lengths=zeros)

    def slice(self, lo: int, hi: int) -> "BatchOutput":
        """Sequences [lo, hi) (one request's share of a merged batch)."""
        if self.outputs is not None:
            return BatchOutput(outputs=self.outputs[lo:hi])
        return BatchOutput(codes=self.codes[lo:hi], messages=self.messages[lo:hi],
                           drafts=self.drafts[lo:hi] if self.drafts is not None else None,
                           num_drafts=self.num_drafts[lo:hi], accepted_drafts=self.accepted_drafts[lo:hi],
                           committed_lengths=self.committed_lengths[lo:hi])

    def to_outputs(self) -> list[StepOutput]:
        """One StepOutput per sequence (for callers of the per-sequence form, and tests)."""
        if self.outputs is not None:
            return self.outputs
        drafts = self.drafts.tolist()
        return [StepOutput(code=c, message=msg, drafts=d[:n], accepted_drafts=a, committed_length=cl)
                for c, msg, d, n, a, cl in zip(self.codes.tolist(), self.messages, drafts, self.num_drafts.tolist(),
                                                self.accepted_drafts.tolist(), self.committed_lengths.tolist())]
