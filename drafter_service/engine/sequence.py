"""Per-sequence drafter state, keyed by (client namespace, sequence id)."""
from dataclasses import dataclass, field

from drafter_service.engine.kv_cache import BlockPool


@dataclass
class Sequence:
    namespace: str
    sequence_id: str
    block_table: list[int] = field(default_factory=list)  # block ids, in position order
    committed_len: int = 0  # draft-KV of positions [0, committed_len) was written from committed tokens
    last_drafts: list[int] = field(default_factory=list)  # drafts given at the last step...
    last_drafts_base: int = 0  # ...for positions last_drafts_base + 1, + 2, ...
    shift_cache: object | None = None  # multi-layer EAGLE only: multi_layer_inputs.ShiftCache


class SequenceTable:
    """All live sequences and the blocks they hold. Only the step worker thread touches it."""

    def __init__(self, pool: BlockPool, block_size: int):
        self.pool = pool
        self.block_size = block_size
        self._seqs: dict[tuple[str, str], Sequence] = {}

    def __len__(self) -> int:
        return len(self._seqs)

    def get(self, namespace: str, sequence_id: str) -> Sequence | None:
        return self._seqs.get((namespace, sequence_id))

    def add(self, seq: Sequence) -> None:
        self._seqs[(seq.namespace, seq.sequence_id)] = seq

    def resize(self, seq: Sequence, num_positions: int) -> bool:
        """Make seq's block table cover exactly positions [0, num_positions): allocate what is missing, give back
        what is past the end. False, with nothing changed, when the pool is short."""
        want = -(-num_positions // self.block_size)
        have = len(seq.block_table)
        if want > have:
            blocks = self.pool.allocate(want - have)
            if blocks is None:
                return False
            seq.block_table.extend(blocks)
        elif want < have:
            self.pool.free(seq.block_table[want:])
            del seq.block_table[want:]
        return True

    def blocks_missing(self, seq: Sequence, num_positions: int) -> int:
        return max(0, -(-num_positions // self.block_size) - len(seq.block_table))

    def release(self, namespace: str, sequence_id: str) -> bool:
        seq = self._seqs.pop((namespace, sequence_id), None)
        if seq is None:
            return False
        self.pool.free(seq.block_table)
        seq.block_table = []
        return True
