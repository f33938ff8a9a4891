"""Per-sequence drafter state, keyed by (client namespace, sequence id), and how long a sequence lives.

Lifetime (docs/protocol.md, "Sequence lifetime: leases, eviction, quotas"); only the step thread touches any of it:

* LRU order: every step that names a sequence stamps its row with the step's serial number, the clock time and the
  table's next touch count (SequenceRows.touch_order; a new sequence gets the next count when it is added), so the
  least recently used sequence is the one with the smallest count, and at admission the sequences of the step being
  admitted are exactly the last ones in that order. evict_idle() takes idle sequences in that order from a queue of
  the least recently used few (argpartition of the column), built when needed and kept across steps. The order lives
  in a column rather than in an OrderedDict that every step re-links: touch_batch is then a lookup per sequence and
  three column writes (at batch 256 the OrderedDict moves were most of the admission's host time, cold as a serving
  step runs it).
* lease: a sequence no step touched for ``lease_s`` is freed (expire(), when expiry_due() says one may be due: a
  scan of the last_used column).
* owner: a sequence first created through a ProposeStream or a step channel belongs to it; release_owner() frees
  them when the stream ends or the channel's client goes away.
* quotas: sequences in all, sequences per namespace, and a namespace's share of the KV blocks (the proposer
  checks them at admission, proposer.py _make_room).

Keys the table dropped on its own (evicted, expired, owner gone) are remembered, a bounded number of them, so that
a later step can be told why its sequence is gone rather than just "unknown".
"""
from collections import OrderedDict
from typing import Callable
from dataclasses import dataclass

import numpy as np

from drafter_service.engine.sequence_rows import SequenceRows
from drafter_service.engine.kv_cache import BlockPool

EVICTION_QUEUE_MIN = 256  # an eviction queue is built with at least this many candidates (or all the idle ones)
GONE_KEYS_KEPT = 16384  # how many dropped keys are remembered for the NOT_FOUND message (oldest forgotten first)

EVICTED_LRU = "evicted (it was idle, least recently used, and the KV pool or the sequence limit needed room)"
EVICTED_FOR_NAMESPACE = ("evicted (it was idle, least recently used, and its namespace was at its quota: "
                         "--max-sequences-per-namespace / --namespace-pool-share)")


@dataclass
class SequenceLimits:
    """How long sequences live and how many a client may hold (config.py: the --sequence-* / --max-sequences* /
    --namespace-pool-share flags)."""

    lease_s: float = 0.0  # a sequence no step touched for this long is freed; 0 = never
    max_sequences: int = 0  # sequences in all; 0 = only the KV pool limits them
    max_sequences_per_namespace: int = 0  # 0 = no limit
    namespace_pool_share: float = 1.0  # fraction of the KV blocks one namespace may hold, in (0, 1]


@dataclass
class SequenceCounters:
    """Plain counters, for the metrics to export (never reset)."""

    evicted: int = 0  # idle sequences freed to make room (pool, --max-sequences or a namespace quota)
    expired: int = 0  # freed by the lease
    owner_closed: int = 0  # freed because the stream / step channel that created them ended
    quota_refusals: int = 0  # steps refused with RESOURCE_EXHAUSTED naming a quota
    pool_refusals: int = 0  # steps refused with RESOURCE_EXHAUSTED because the pool was full of busy sequences


class _RowValue:
    """A Sequence attribute that lives in its table row's column (a memoryview of SequenceRows named ``view``) while
    the sequence holds a row, and on the object (``_<name>``) before and after."""

    def __init__(self, view: str, doc: str):
        self.view, self.__doc__ = view, doc

    def __set_name__(self, owner, name: str) -> None:
        self.loose = "_" + name

    def __get__(self, seq: "Sequence | None", owner=None):
        if seq is None:
            return self
        rows = seq.rows
        return getattr(seq, self.loose) if rows is None else getattr(rows, self.view)[seq.table_row]

    def __set__(self, seq: "Sequence", value) -> None:
        rows = seq.rows
        if rows is None:
            setattr(seq, self.loose, value)
        else:
            getattr(rows, self.view)[seq.table_row] = value


class Sequence:
    """One sequence's drafter state. Its step state (committed_len, last_drafts, last_drafts_base, whether it
    pre-drafts, last_used, last_step) lives in the table's columns (sequence_rows.py) while it holds a row, so that a
    step over a batch reads and writes it with array ops; the attributes below read and write the same values one
    sequence at a time. Before it gets a row (a new sequence being admitted) and after it lost it (dropped) they live
    on the object."""

    committed_len = _RowValue("committed_mv", "Draft-KV of positions [0, committed_len) was written from committed "
                                              "tokens.")
    last_drafts_base = _RowValue("drafts_base_mv", "The last drafts were for positions last_drafts_base + 1, + 2, ...")
    last_used = _RowValue("last_used_mv", "Clock time of the last step that named it (the lease).")
    last_step = _RowValue("last_step_mv", "Serial number of that step (an idle sequence is one the current step does "
                                          "not name).")

    def __init__(self, namespace: str, sequence_id: str, owner: str | None = None, last_used: float = 0.0,
                 last_step: int = 0):
        self.namespace = namespace
        self.sequence_id = sequence_id
        self.table_row = -1  # its row of SequenceTable.rows; -1: none (not admitted yet, or dropped)
        self.rows: SequenceRows | None = None  # the table's columns while table_row >= 0
        self.shift_cache: object | None = None  # multi-layer EAGLE only: multi_layer_inputs.ShiftCache
        self.owner = owner  # "stream N" / "step channel N" that created it (freed with it); None: unary
        self._predraft: object | None = None  # predraft.PredraftState while the sequence pre-drafts
        # the step state while the sequence holds no row
        self._committed_len = 0
        self._last_drafts: list[int] = []
        self._last_drafts_base = 0
        self._last_used = last_used
        self._last_step = last_step

    def __repr__(self) -> str:
        return (f"Sequence({self.namespace!r}, {self.sequence_id!r}, row {self.table_row}, "
                f"{self.num_blocks} blocks, committed_len {self.committed_len})")

    @property
    def block_table(self) -> list[int]:
        """Its block ids, in position order (a new list: the table's row holds them, SequenceTable.resize and
        grow_rows change them; a sequence without a row holds none)."""
        if self.rows is None:
            return []
        row = self.table_row
        return self.rows.block_tables_np[row, : self.rows.num_blocks_mv[row]].tolist()

    @property
    def num_blocks(self) -> int:
        """len(block_table), without building the list."""
        return 0 if self.rows is None else self.rows.num_blocks_mv[self.table_row]

    @property
    def last_drafts(self) -> list[int]:
        """The drafts given at the last step (a new list: assign, never change it in place)."""
        if self.rows is None:
            return list(self._last_drafts)
        return self.rows.read_step(self.table_row)[2]

    @last_drafts.setter
    def last_drafts(self, drafts: list[int]) -> None:
        if self.rows is None:
            self._last_drafts = list(drafts)
        else:
            self.rows.set_drafts(self.table_row, drafts)

    @property
    def predraft(self) -> object | None:
        """predraft.PredraftState while the sequence pre-drafts (its row's predrafting flag says whether)."""
        return self._predraft

    @predraft.setter
    def predraft(self, state: object | None) -> None:
        self._predraft = state
        if self.rows is not None:
            self.rows.predrafting_mv[self.table_row] = state is not None

    def take_row(self, rows: SequenceRows, row: int) -> None:
        """Move the step state into row `row` of `rows` (all zero), where it lives from now on."""
        committed, drafts, base = self._committed_len, self._last_drafts, self._last_drafts_base
        used, step = self._last_used, self._last_step
        self.rows, self.table_row = rows, row
        self.committed_len, self.last_drafts, self.last_drafts_base = committed, drafts, base
        self.last_used, self.last_step = used, step
        self.predraft = self._predraft

    def give_row_back(self) -> int:
        """Move the step state out of its row back onto the object; returns the row (for the table to free)."""
        committed, drafts, base = self.committed_len, self.last_drafts, self.last_drafts_base
        used, step = self.last_used, self.last_step
        row, self.rows, self.table_row = self.table_row, None, -1
        self._committed_len, self._last_drafts, self._last_drafts_base = committed, drafts, base
        self._last_used, self._last_step = used, step
        return row


@dataclass
class _EvictionQueue:
    """Eviction candidates (SequenceTable.evict_idle): idle sequences' rows, least recently used first."""

    serial: int  # the step it was built in
    rows: np.ndarray  # [n] int64: the idle rows of least touch_order (all of them when exhaustive), in that order
    orders: np.ndarray  # [n] int64: their touch_order then (a row whose order changed since was dropped or touched)
    exhaustive: bool  # rows held every idle row of the namespace in step `serial`
    next: int = 0  # rows before this one were taken


@dataclass
class _Lookup:
    """SequenceTable.touch_batch's answer for one batch of known, distinct sequences."""

    membership: int  # SequenceTable._membership when it was looked up
    namespaces: list[str]
    sequence_ids: list[str]
    seqs: list[Sequence]
    rows: np.ndarray  # [n] int64, read-only, no row twice


def no_row_twice(rows: np.ndarray) -> bool:
    """Whether [n] table rows name no row twice (one set of Python ints: faster than np.unique at step sizes)."""
    return len(set(rows.tolist())) == rows.shape[0]


class SequenceTable:
    """All live sequences and the blocks they hold. Only the step worker thread touches it."""

    def __init__(self, pool: BlockPool, block_size: int, limits: SequenceLimits | None = None,
                 max_model_len: int | None = None):
        self.pool = pool
        self.block_size = block_size
        # every sequence's block table and step state as columns by row (sequence_rows.py; resize, _drop)
        max_blocks = -(-max_model_len // block_size) if max_model_len else pool.num_blocks
        self.rows = SequenceRows(min(max_blocks, pool.num_blocks))
        self.limits = limits or SequenceLimits()
        self.counters = SequenceCounters()
        self._seqs: dict[tuple[str, str], Sequence] = {}  # (the LRU order is the rows' touch_order column)
        self._by_ns: dict[str, dict[str, Sequence]] = {}  # per namespace: sequence id -> Sequence
        self._touches = 0  # touches and additions so far: the last one's touch_order
        self._membership = 0  # bumped by every add and drop: a touch_batch answer stays true while it is unchanged
        self._last_lookup: _Lookup | None = None  # touch_batch's last answer for a batch of known, distinct sequences
        self._row_seq: list[Sequence | None] = []  # the sequence holding each row (None: none, or not added yet)
        self._queues: dict[str | None, _EvictionQueue] = {}  # evict_idle's candidates, by namespace (None: all)
        self._ns_blocks: dict[str, int] = {}  # blocks held per namespace
        self._owned: dict[str, set[tuple[str, str]]] = {}  # owner -> keys of the sequences it created
        self._gone: OrderedDict[tuple[str, str], str] = OrderedDict()  # key -> why the table dropped it
        self.on_drop: Callable[[Sequence], None] = lambda seq: None  # (the pre-drafter frees the sequence's branches)
        share = self.limits.namespace_pool_share
        # blocks one namespace may hold; None: no share limit (the pool itself is the limit)
        self.namespace_block_limit = None if share >= 1.0 else max(1, int(share * pool.num_blocks))

    def __len__(self) -> int:
        return len(self._seqs)

    def get(self, namespace: str, sequence_id: str) -> Sequence | None:
        return self._seqs.get((namespace, sequence_id))

    def touch_batch(self, namespaces: list[str], sequence_ids: list[str], now: float,
                    step_serial: int) -> tuple[list[Sequence | None], np.ndarray]:
        """Each (namespace, sequence_id) pair's sequence, in order (None for an unknown one), marked as used by step
        `step_serial` at `now` and as the most recently used, in the order given; and the known ones' table rows, in
        order ([n] int64). One call for a whole step: a lookup per sequence (by id alone when the step has one
        namespace), then the marks written as columns."""
        R = self.rows
        n = len(sequence_ids)
        if n <= 8:  # a few sequences: a plain loop costs less than setting up the C loops below
            get, used, step, order = self._seqs.get, R.last_used_mv, R.last_step_mv, R.touch_order_mv
            touches = self._touches
            seqs, rows = [], []
            for key in zip(namespaces, sequence_ids):
                seq = get(key)
                if seq is not None:
                    row = seq.table_row
                    touches += 1
                    used[row], step[row], order[row] = now, step_serial, touches
                    rows.append(row)
                seqs.append(seq)
            self._touches = touches
            return seqs, np.array(rows, dtype=np.int64)
        last = self._still_valid_lookup(namespaces, sequence_ids)
        if last is not None:
            # the same sequences as the last call, none added or dropped since (an engine's usual step): its answer
            # again (two list compares in C, ~1.5 us at 128 sequences against ~10 us of lookups)
            seqs, found, rows = last.seqs, last.seqs, last.rows
        else:
            one_namespace = self._by_ns.get(namespaces[0])
            if one_namespace is not None and list(namespaces).count(namespaces[0]) == n:  # the common case
                seqs = list(map(one_namespace.get, sequence_ids))
            else:
                seqs = list(map(self._seqs.get, zip(namespaces, sequence_ids)))
            found = seqs if None not in seqs else [seq for seq in seqs if seq is not None]
            rows = np.fromiter([seq.table_row for seq in found], dtype=np.int64, count=len(found))
            rows.flags.writeable = False  # (it may be returned again: callers index with it, never write it)
            self._last_lookup = (_Lookup(self._membership, list(namespaces), list(sequence_ids), seqs, rows)
                                 if found is seqs and no_row_twice(rows) else None)
        R.last_used[rows] = now
        R.last_step[rows] = step_serial
        # (a sequence named twice keeps its last count, as the last touch)
        R.touch_order[rows] = np.arange(self._touches + 1, self._touches + 1 + len(found))
        self._touches += len(found)
        return seqs, rows

    def known_rows(self, namespaces: list[str], sequence_ids: list[str]) -> tuple[np.ndarray | None, np.ndarray]:
        """touch_batch's lookup with nothing marked (Proposer.rehearse_columns): (keep, rows), rows [n] int64 the
        table rows of the pairs this table knows, in order; keep None when it knows them all, else [n] int64 their
        indices among the pairs (a step some of whose sequences are gone since)."""
        last = self._still_valid_lookup(namespaces, sequence_ids)
        if last is not None:
            return None, last.rows
        seqs = list(map(self._seqs.get, zip(namespaces, sequence_ids)))
        if None not in seqs:
            return None, np.fromiter([seq.table_row for seq in seqs], dtype=np.int64, count=len(seqs))
        keep = [i for i, seq in enumerate(seqs) if seq is not None]
        return (np.array(keep, dtype=np.int64),
                np.fromiter([seqs[i].table_row for i in keep], dtype=np.int64, count=len(keep)))

    def _still_valid_lookup(self, namespaces: list[str], sequence_ids: list[str]) -> "_Lookup | None":
        """touch_batch's last answer when it was for these sequences and none has been added or dropped since."""
        last = self._last_lookup
        if (last is not None and last.membership == self._membership and last.sequence_ids == sequence_ids
                and last.namespaces == namespaces):
            return last
        return None

    def distinct(self, rows: np.ndarray) -> bool:
        """Whether touch_batch's rows name no row twice: known for its last answer, counted otherwise."""
        last = self._last_lookup
        return (last is not None and rows is last.rows) or no_row_twice(rows)

    def lru_order(self, namespace: str | None = None) -> list[Sequence]:
        """The sequences (of `namespace`; None: all of them), least recently used first."""
        rows = self._member_rows(namespace)
        return [self._row_seq[r] for r in rows[np.argsort(self.rows.touch_order[rows])].tolist()]

    def _member_rows(self, namespace: str | None = None) -> np.ndarray:
        """[n] int64: the rows of the table's sequences (of `namespace`; None: all), in no order. A member's row has
        a touch_order of 1 or more (add() sets it); any other row has 0 (free, or assigned by resize() to a
        sequence not added yet)."""
        if namespace is None:
            return np.flatnonzero(self.rows.touch_order)
        seqs = self._by_ns.get(namespace, {})
        return np.fromiter([seq.table_row for seq in seqs.values()], dtype=np.int64, count=len(seqs))

    def add(self, seq: Sequence) -> None:
        """Insert seq (its blocks were already counted by resize) as the most recently used."""
        if seq.table_row < 0:
            raise ValueError(f"{seq!r} holds no row: resize it before adding it")
        key = (seq.namespace, seq.sequence_id)
        self._seqs[key] = seq
        self._by_ns.setdefault(seq.namespace, {})[seq.sequence_id] = seq
        row = seq.table_row
        if row >= len(self._row_seq):
            self._row_seq.extend([None] * (row + 1 - len(self._row_seq)))
        self._row_seq[row] = seq
        self._membership += 1
        self._touches += 1
        self.rows.touch_order_mv[row] = self._touches
        if seq.owner is not None:
            self._owned.setdefault(seq.owner, set()).add(key)
        self._gone.pop(key, None)

    def resize(self, seq: Sequence, num_positions: int) -> bool:
        """Make seq's block table cover exactly positions [0, num_positions): allocate what is missing, give back
        what is past the end. False, with nothing changed, when the pool is short."""
        want = self.blocks_for(num_positions)
        have = seq.num_blocks
        if want > have:
            if want - have > self.pool.num_free:
                return False
            self.rows.check_fits(want)  # (raises before anything is taken)
            blocks = self.pool.allocate(want - have)
            if seq.table_row < 0:
                seq.take_row(self.rows, self.rows.assign())
            self.rows.write(seq.table_row, have, blocks)
        elif want < have:
            self.pool.free(self.rows.block_tables_np[seq.table_row, want:have].tolist())
            self.rows.clear(seq.table_row, want)
        if want != have:
            self._ns_blocks[seq.namespace] = self._ns_blocks.get(seq.namespace, 0) + want - have
        return True

    def blocks_for(self, num_positions: int) -> int:
        """Blocks that hold positions [0, num_positions)."""
        return -(-num_positions // self.block_size)

    def blocks_missing(self, seq: Sequence, num_positions: int) -> int:
        return max(0, self.blocks_for(num_positions) - seq.num_blocks)

    def grow_rows(self, rows: np.ndarray, have: np.ndarray, more: np.ndarray, namespace_blocks: dict[str, int]) -> bool:
        """resize for a whole step's growing sequences at once (Proposer._step_columns): the sequences holding `rows`
        ([n] int64, distinct; members, or new ones about to be added) go from have[i] blocks to have[i] + more[i]
        (more[i] > 0; [n] int64 each), all taken from the pool in one call, in row order (the blocks a resize of
        each in turn would take), written into the rows with one array op. namespace_blocks: how many more blocks
        each namespace takes (they sum to more). False, with nothing changed, when the pool is short."""
        total = int(more.sum())
        if total > self.pool.num_free:
            return False
        want = have + more
        self.rows.check_fits(int(want.max()))  # (raises before anything is taken)
        blocks = self.pool.allocate(total)
        if total == rows.shape[0]:  # one block each: a decode step's usual growth
            self.rows.block_tables_np[rows, have] = blocks
        else:  # block j of the allocation goes to row rows[i] at column have[i] + (j - first[i]), first[i] being the
            first = np.cumsum(more) - more  # first block of row i's share
            self.rows.block_tables_np[np.repeat(rows, more), np.repeat(have - first, more) + np.arange(total)] = blocks
        self.rows.num_blocks[rows] = want
        for namespace, n in namespace_blocks.items():
            self._ns_blocks[namespace] = self._ns_blocks.get(namespace, 0) + n
        return True

    def namespace_sequences(self, namespace: str) -> int:
        return len(self._by_ns.get(namespace, ()))

    def namespace_blocks(self, namespace: str) -> int:
        return self._ns_blocks.get(namespace, 0)

    def release(self, namespace: str, sequence_id: str) -> bool:
        """Free a sequence the client is done with (Release, or a failed step's new sequence)."""
        seq = self._seqs.get((namespace, sequence_id))
        if seq is None:
            return False
        self._drop(seq, None)
        return True

    def why_gone(self, namespace: str, sequence_id: str) -> str | None:
        """Why the table dropped this key on its own ("evicted ...", "expired ...", "freed ..."), if it remembers."""
        return self._gone.get((namespace, sequence_id))

    # ---- lifetime: eviction, lease, owners ----

    def evict_idle(self, step_serial: int, *, blocks: int = 0, sequences: int = 0, namespace: str | None = None,
                   reason: str = EVICTED_LRU) -> bool:
        """Evict idle sequences (not named by step `step_serial`), least recently used first, of `namespace` (None:
        of any), until they gave back at least `blocks` blocks and `sequences` sequences. False, evicting nothing,
        when all the idle ones together would not be enough. The candidates come from an _EvictionQueue, built
        from the columns and taken from until it runs out, across steps (a full pool evicts for every new
        sequence)."""
        R = self.rows
        want = max(blocks, sequences, 1)
        while True:
            q = self._eviction_queue(step_serial, namespace, want)
            victims, got, i = [], 0, q.next
            while (got < blocks or len(victims) < sequences) and i < q.rows.shape[0]:
                row = int(q.rows[i])
                i += 1
                if R.touch_order[row] != q.orders[i - 1]:  # dropped, or touched, since the queue was built
                    continue
                victims.append(self._row_seq[row])
                got += int(R.num_blocks[row])
            if got >= blocks and len(victims) >= sequences:
                break
            if q.exhaustive and q.serial == step_serial:
                return False
            want = 2 * q.rows.shape[0]  # (the queue held only the least recently used few: build a longer one)
            self._queues.pop(namespace)
        q.next = i
        for seq in victims:
            self._drop(seq, reason)
        self.counters.evicted += len(victims)
        return True

    def _eviction_queue(self, step_serial: int, namespace: str | None, want: int) -> "_EvictionQueue":
        """Eviction candidates of `namespace`, least recently used first, with at least `want` entries not taken
        yet (or all the idle ones): the queue built before, or a new one. An old queue stays right across steps:
        touch orders only grow, so every row outside it is more recent than each of its rows whose order has not
        changed (those were touched by no step since, so they are idle); the others are skipped."""
        q = self._queues.get(namespace)
        if q is not None and (q.rows.shape[0] - q.next >= want or (q.exhaustive and q.serial == step_serial)):
            return q
        R = self.rows
        rows = self._member_rows(namespace)
        idle = rows[R.last_step[rows] != step_serial]  # (touch_batch stamped the step's own sequences)
        want = max(want, EVICTION_QUEUE_MIN)  # (room for the step's next evictions)
        exhaustive = want >= idle.shape[0]
        if not exhaustive:  # only the `want` least recently used are sorted
            idle = idle[np.argpartition(R.touch_order[idle], want - 1)[:want]]
        idle = idle[np.argsort(R.touch_order[idle])]
        q = _EvictionQueue(step_serial, idle, R.touch_order[idle].copy(), exhaustive)
        self._queues[namespace] = q
        return q

    def expire(self, now: float) -> int:
        """Free every sequence no step touched for the lease, least recently used first; returns how many."""
        lease = self.limits.lease_s
        if lease <= 0:
            return 0
        why = f"expired (no step for {lease:g} s: --sequence-lease-s)"
        rows = self._member_rows()
        due = rows[now - self.rows.last_used[rows] >= lease]
        for r in due[np.argsort(self.rows.touch_order[due])].tolist():
            self._drop(self._row_seq[r], why)
        self.counters.expired += due.shape[0]
        return due.shape[0]

    def expiry_due(self, now: float) -> float:
        """The earliest time a sequence can expire (with no lease: never)."""
        if self.limits.lease_s <= 0:
            return float("inf")
        rows = self._member_rows()
        if not rows.shape[0]:
            return now + self.limits.lease_s  # anything added from now on is stamped at >= now
        # (a later touch or addition only stamps a later time: the answer stays early enough until expire() runs)
        return float(self.rows.last_used[rows].min()) + self.limits.lease_s

    def release_owner(self, owner: str) -> int:
        """Free every sequence `owner` created (its stream ended / its channel's client went away)."""
        keys = self._owned.pop(owner, ())
        why = f"freed when the {owner} that created it closed"
        n = 0
        for key in list(keys):
            seq = self._seqs.get(key)
            if seq is not None and seq.owner == owner:
                self._drop(seq, why)
                n += 1
        self.counters.owner_closed += n
        return n

    def _drop(self, seq: Sequence, why: str | None) -> None:
        self.on_drop(seq)
        self._membership += 1
        key = (seq.namespace, seq.sequence_id)
        del self._seqs[key]
        ns_seqs = self._by_ns[seq.namespace]
        del ns_seqs[seq.sequence_id]
        if not ns_seqs:
            del self._by_ns[seq.namespace]
        blocks = seq.block_table
        held = self._ns_blocks.get(seq.namespace, 0) - len(blocks)
        if held:
            self._ns_blocks[seq.namespace] = held
        else:
            self._ns_blocks.pop(seq.namespace, None)
        self.pool.free(blocks)
        if seq.table_row >= 0:
            self._row_seq[seq.table_row] = None
            self.rows.release(seq.give_row_back())
        if seq.owner is not None:
            owned = self._owned.get(seq.owner)
            if owned is not None:
                owned.discard(key)
                if not owned:
                    del self._owned[seq.owner]
        if why is not None:
            self._gone[key] = why
            self._gone.move_to_end(key)
            if len(self._gone) > GONE_KEYS_KEPT:
                self._gone.popitem(last=False)
