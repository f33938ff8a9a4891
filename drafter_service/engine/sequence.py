"""Per-sequence drafter state, keyed by (client namespace, sequence id), and how long a sequence lives.

Lifetime (docs/protocol.md, "Sequence lifetime: leases, eviction, quotas"); only the step thread touches any of it:

* LRU order: the table is an OrderedDict in least-recently-used order (a per-namespace one keeps the same order).
  Every step that names a sequence moves it to the end (touch) and stamps it with the step's serial number, so
  at admission the sequences of the step being admitted are exactly the tail of the order, and the idle ones the
  head: evict_idle() takes from the head and stops at the first sequence of the current step.
* lease: a sequence no step touched for ``lease_s`` is freed (expire(); the order is also last-use order, so only
  the head needs looking at).
* owner: a sequence first created through a ProposeStream or a step channel belongs to it; release_owner() frees
  them when the stream ends or the channel's client goes away.
* quotas: sequences in all, sequences per namespace, and a namespace's share of the KV blocks (the proposer
  checks them at admission, proposer.py _make_room).

Keys the table dropped on its own (evicted, expired, owner gone) are remembered, a bounded number of them, so that
a later step can be told why its sequence is gone rather than just "unknown".
"""
from collections import OrderedDict
from typing import Callable
from dataclasses import dataclass, field

from drafter_service.engine.block_tables import BlockTables
from drafter_service.engine.kv_cache import BlockPool

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


@dataclass
class Sequence:
    namespace: str
    sequence_id: str
    block_table: list[int] = field(default_factory=list)  # block ids, in position order
    table_row: int = -1  # its row of SequenceTable.block_tables (the same ids as a tensor); -1: none yet
    committed_len: int = 0  # draft-KV of positions [0, committed_len) was written from committed tokens
    last_drafts: list[int] = field(default_factory=list)  # drafts given at the last step...
    last_drafts_base: int = 0  # ...for positions last_drafts_base + 1, + 2, ...
    shift_cache: object | None = None  # multi-layer EAGLE only: multi_layer_inputs.ShiftCache
    owner: str | None = None  # "stream N" / "step channel N" that created it (freed with it); None: unary
    last_used: float = 0.0  # clock time of the last step that named it (lease)
    last_step: int = 0  # serial number of that step (an idle sequence is one the current step does not name)
    predraft: object | None = None  # predraft.PredraftState while the sequence pre-drafts


class SequenceTable:
    """All live sequences and the blocks they hold. Only the step worker thread touches it."""

    def __init__(self, pool: BlockPool, block_size: int, limits: SequenceLimits | None = None,
                 max_model_len: int | None = None):
        self.pool = pool
        self.block_size = block_size
        # every sequence's block table as a tensor row, kept equal to its list (resize, _drop)
        max_blocks = -(-max_model_len // block_size) if max_model_len else pool.num_blocks
        self.block_tables = BlockTables(min(max_blocks, pool.num_blocks))
        self.limits = limits or SequenceLimits()
        self.counters = SequenceCounters()
        self._seqs: OrderedDict[tuple[str, str], Sequence] = OrderedDict()  # least recently used first
        self._by_ns: dict[str, OrderedDict[str, Sequence]] = {}  # per namespace, in the same order
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
                    step_serial: int) -> list[Sequence | None]:
        """Each (namespace, sequence_id) pair's sequence, in order (None for an unknown one), marked as used by step
        `step_serial` at `now` and moved to the most recently used end, in the order given. One call for a whole step:
        a call per sequence was a quarter of the columns path's admission."""
        seqs, by_ns = self._seqs, self._by_ns
        get, to_end = seqs.get, seqs.move_to_end
        out = []
        for key in zip(namespaces, sequence_ids):
            seq = get(key)
            if seq is not None:
                to_end(key)
                by_ns[key[0]].move_to_end(key[1])
                seq.last_used, seq.last_step = now, step_serial
            out.append(seq)
        return out

    def add(self, seq: Sequence) -> None:
        """Insert seq (its blocks were already counted by resize) as the most recently used."""
        key = (seq.namespace, seq.sequence_id)
        self._seqs[key] = seq
        self._by_ns.setdefault(seq.namespace, OrderedDict())[seq.sequence_id] = seq
        if seq.owner is not None:
            self._owned.setdefault(seq.owner, set()).add(key)
        self._gone.pop(key, None)

    def resize(self, seq: Sequence, num_positions: int) -> bool:
        """Make seq's block table cover exactly positions [0, num_positions): allocate what is missing, give back
        what is past the end. False, with nothing changed, when the pool is short."""
        want = self.blocks_for(num_positions)
        have = len(seq.block_table)
        if want > have:
            blocks = self.pool.allocate(want - have)
            if blocks is None:
                return False
            seq.block_table.extend(blocks)
            if seq.table_row < 0:
                seq.table_row = self.block_tables.assign()
            self.block_tables.write(seq.table_row, have, blocks)
        elif want < have:
            self.pool.free(seq.block_table[want:])
            del seq.block_table[want:]
            self.block_tables.clear(seq.table_row, want)
        if want != have:
            self._ns_blocks[seq.namespace] = self._ns_blocks.get(seq.namespace, 0) + want - have
        return True

    def blocks_for(self, num_positions: int) -> int:
        """Blocks that hold positions [0, num_positions)."""
        return -(-num_positions // self.block_size)

    def blocks_missing(self, seq: Sequence, num_positions: int) -> int:
        return max(0, self.blocks_for(num_positions) - len(seq.block_table))

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
        when all the idle ones together would not be enough."""
        order = self._seqs if namespace is None else self._by_ns.get(namespace, {})
        victims, got_blocks = [], 0
        for seq in order.values():
            if got_blocks >= blocks and len(victims) >= sequences:
                break
            # touch_batch moved the step's sequences to the end: no idle one after the first of them
            if seq.last_step == step_serial:
                break
            victims.append(seq)
            got_blocks += len(seq.block_table)
        if got_blocks < blocks or len(victims) < sequences:
            return False
        for seq in victims:
            self._drop(seq, reason)
        self.counters.evicted += len(victims)
        return True

    def expire(self, now: float) -> int:
        """Free every sequence no step touched for the lease; returns how many."""
        lease = self.limits.lease_s
        if lease <= 0:
            return 0
        why = f"expired (no step for {lease:g} s: --sequence-lease-s)"
        n = 0
        while self._seqs:
            seq = next(iter(self._seqs.values()))  # the least recently used: the order is last-use order
            if now - seq.last_used < lease:
                break
            self._drop(seq, why)
            n += 1
        self.counters.expired += n
        return n

    def expiry_due(self, now: float) -> float:
        """The earliest time a sequence can expire (with no lease: never)."""
        if self.limits.lease_s <= 0:
            return float("inf")
        if not self._seqs:
            return now + self.limits.lease_s  # anything added from now on is stamped at >= now
        return next(iter(self._seqs.values())).last_used + self.limits.lease_s

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
        key = (seq.namespace, seq.sequence_id)
        del self._seqs[key]
        ns_order = self._by_ns[seq.namespace]
        del ns_order[seq.sequence_id]
        if not ns_order:
            del self._by_ns[seq.namespace]
        held = self._ns_blocks.get(seq.namespace, 0) - len(seq.block_table)
        if held:
            self._ns_blocks[seq.namespace] = held
        else:
            self._ns_blocks.pop(seq.namespace, None)
        self.pool.free(seq.block_table)
        seq.block_table = []
        if seq.table_row >= 0:
            self.block_tables.release(seq.table_row)
            seq.table_row = -1
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
