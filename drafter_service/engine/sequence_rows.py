"""Every live sequence's step state as columns indexed by its table row, so that a step over many sequences reads
and writes that state with array ops instead of attribute accesses per sequence (Proposer.step_batch; at batch 128
the per-sequence reads and writes were a quarter of its host work on the dev CPU).

  block_tables   [rows, max_blocks] int32 (torch)  the block ids, in position order, then zeros
  num_blocks     [rows] int64     how many of them
  committed_len  [rows] int64     Sequence.committed_len
  drafts_base    [rows] int64     Sequence.last_drafts_base
  num_drafts     [rows] int64     len(Sequence.last_drafts)
  drafts         [rows, K] int64  Sequence.last_drafts in the first num_drafts entries (K grows to the largest k)
  predrafting    [rows] bool      Sequence.predraft is not None
  last_used      [rows] float64   Sequence.last_used: clock time of the last step that named it (the lease)
  last_step      [rows] int64     Sequence.last_step: that step's serial number
  touch_order    [rows] int64     the table's count of touches when the sequence was last touched or added: the
                                  least recently used sequence has the smallest (SequenceTable's LRU order)

The columns *are* the state while a sequence holds a row, its block table included (SequenceTable.resize and
grow_rows change it, _drop frees it; ``Sequence.block_table`` reads it): Sequence's properties read and write them. A
sequence holds blocks only while it holds a row. A free row is all zero. Rows are handed out lowest first and every
column doubles its rows when full; max_blocks is cdiv(max_model_len, block_size), the most blocks a sequence can hold.

Batch steps read and write the columns with numpy ops; one sequence (Sequence's properties, and read_steps /
write_steps for a few rows) goes through memoryviews of the same arrays: a scalar access costs ~25 ns there against
50-90 ns through numpy, and a numpy op on a few rows costs about a microsecond whatever their number.
"""
import numpy as np
import torch

STATE_COLUMNS = ("num_blocks", "committed_len", "drafts_base", "num_drafts", "drafts", "predrafting", "last_used",
                 "last_step", "touch_order")
FEW_ROWS = 8  # read_steps / write_steps go row by row (memoryviews) for up to this many rows, else numpy ops


class SequenceRows:
    def __init__(self, max_blocks: int, rows: int = 64, max_drafts: int = 8):
        self.max_blocks = max_blocks
        self.block_tables = torch.zeros(rows, max_blocks, dtype=torch.int32)
        self.block_tables_np = self.block_tables.numpy()  # (a view: numpy indexing is cheaper than torch's)
        self.num_blocks = np.zeros(rows, dtype=np.int64)
        self.committed_len = np.zeros(rows, dtype=np.int64)
        self.drafts_base = np.zeros(rows, dtype=np.int64)
        self.num_drafts = np.zeros(rows, dtype=np.int64)
        self.drafts = np.zeros((rows, max_drafts), dtype=np.int64)
        self.predrafting = np.zeros(rows, dtype=bool)
        self.last_used = np.zeros(rows, dtype=np.float64)
        self.last_step = np.zeros(rows, dtype=np.int64)
        self.touch_order = np.zeros(rows, dtype=np.int64)
        self._free = list(range(rows - 1, -1, -1))  # a stack: the lowest free row on top
        self._make_views()

    def _make_views(self) -> None:
        """Scalar access to the columns (memoryviews of the arrays; made again whenever an array is replaced)."""
        self.num_blocks_mv = memoryview(self.num_blocks)
        self.committed_mv = memoryview(self.committed_len)
        self.drafts_base_mv = memoryview(self.drafts_base)
        self.num_drafts_mv = memoryview(self.num_drafts)
        self.drafts_mv = memoryview(self.drafts.reshape(-1))  # row r's drafts at [r * width, r * width + n)
        self.drafts_width = self.drafts.shape[1]
        self.predrafting_mv = memoryview(self.predrafting)
        self.last_used_mv = memoryview(self.last_used)
        self.last_step_mv = memoryview(self.last_step)
        self.touch_order_mv = memoryview(self.touch_order)

    def assign(self) -> int:
        """A free row (all zero) for a new sequence."""
        if not self._free:
            old = self.block_tables.shape[0]
            # a normal tensor even when grown inside a step's inference mode: Release and the leases update it
            # outside one, which an inference tensor refuses
            with torch.inference_mode(False):
                grown = torch.zeros(2 * old, self.max_blocks, dtype=torch.int32)
                grown[:old] = self.block_tables
            self.block_tables, self.block_tables_np = grown, grown.numpy()
            for name in STATE_COLUMNS:
                column = getattr(self, name)
                wider = np.zeros((2 * old, *column.shape[1:]), dtype=column.dtype)
                wider[:old] = column
                setattr(self, name, wider)
            self._free = list(range(2 * old - 1, old - 1, -1))
            self._make_views()
        return self._free.pop()

    def release(self, row: int) -> None:
        self.block_tables[row].zero_()
        for name in STATE_COLUMNS:
            getattr(self, name)[row] = 0
        self._free.append(row)

    def check_fits(self, num_blocks: int) -> None:
        """Raise unless a row holds num_blocks blocks (before any is taken from the pool)."""
        if num_blocks > self.max_blocks:
            raise ValueError(f"a sequence of {num_blocks} blocks; at most {self.max_blocks}")

    def write(self, row: int, start: int, blocks: list[int]) -> None:
        """Blocks start, start + 1, ... of the row's sequence are `blocks` (its last ones)."""
        self.check_fits(len(blocks) + start)
        self.block_tables_np[row, start : start + len(blocks)] = blocks
        self.num_blocks[row] = start + len(blocks)

    def clear(self, row: int, start: int) -> None:
        """The row's sequence gave back its blocks from `start` on."""
        self.block_tables_np[row, start:] = 0
        self.num_blocks[row] = start

    def gather(self, rows: list[int], width: int) -> torch.Tensor:
        """[len(rows), width] int32: the first `width` block ids of each row (a new tensor)."""
        return torch.from_numpy(self.block_tables_np[rows, :width])

    def read_steps(self, rows: np.ndarray) -> list[tuple[int, int, list[int]]]:
        """(committed_len, drafts_base, last drafts) of each row ([n] int64), as Python values (the per-sequence step
        reads them so, for the whole step at once)."""
        if rows.shape[0] <= FEW_ROWS:
            return [self.read_step(r) for r in rows.tolist()]
        n = self.num_drafts[rows].tolist()
        drafts = self.drafts[rows, : max(n, default=0)].tolist()
        return [(c, b, d[:k]) for c, b, d, k in zip(self.committed_len[rows].tolist(), self.drafts_base[rows].tolist(),
                                                    drafts, n)]

    def read_step(self, row: int) -> tuple[int, int, list[int]]:
        at = row * self.drafts_width
        return (self.committed_mv[row], self.drafts_base_mv[row],
                self.drafts_mv[at : at + self.num_drafts_mv[row]].tolist())

    def write_steps(self, rows: list[int], ends: list[int], drafts: list[list[int]]) -> None:
        """After a step: row rows[i]'s sequence committed ends[i] positions and was given drafts[i] for the positions
        after it (rows distinct)."""
        if len(rows) <= FEW_ROWS:
            for row, end, d in zip(rows, ends, drafts):
                self.committed_mv[row] = self.drafts_base_mv[row] = end
                self.set_drafts(row, d)
            return
        ks = [len(d) for d in drafts]
        K = max(ks, default=0)
        if ks.count(K) != len(ks):  # (mixed k: pad to K; the entries past a row's k are never read)
            drafts = [d + [0] * (K - len(d)) for d in drafts]
        self.write_step_columns(np.array(rows, dtype=np.int64), np.array(ends, dtype=np.int64),
                                np.array(drafts, dtype=np.int64).reshape(len(rows), K), np.array(ks, dtype=np.int64))

    def write_step_columns(self, rows: np.ndarray, ends: np.ndarray, drafts: np.ndarray, ks: np.ndarray) -> None:
        """write_steps from arrays: rows, ends, ks [B] int64 (rows distinct); drafts [B, K] int64, row i's first ks[i]
        entries its drafts."""
        self.committed_len[rows] = ends
        self.drafts_base[rows] = ends
        K = drafts.shape[1]
        self.fit_drafts(K)
        self.drafts[rows, :K] = drafts
        self.num_drafts[rows] = ks

    def set_drafts(self, row: int, drafts: list[int]) -> None:
        if len(drafts) > self.drafts_width:
            self.fit_drafts(len(drafts))
        at, mv = row * self.drafts_width, self.drafts_mv
        for d in drafts:
            mv[at] = d
            at += 1
        self.num_drafts_mv[row] = len(drafts)

    def fit_drafts(self, k: int) -> None:
        """Make the drafts column hold at least k drafts per row."""
        width = self.drafts.shape[1]
        if k > width:
            wider = np.zeros((self.drafts.shape[0], max(k, 2 * width)), dtype=np.int64)
            wider[:, :width] = self.drafts
            self.drafts = wider
            self._make_views()
