"""Block allocator and per-sequence block tables."""
import random

import numpy as np
import pytest

from drafter_service.engine.kv_cache import BlockPool
from drafter_service.engine.sequence import Sequence, SequenceTable


def test_allocate_free_all_or_nothing():
    pool = BlockPool(10)
    a = pool.allocate(4)
    b = pool.allocate(6)
    assert len(set(a) | set(b)) == 10 and pool.num_free == 0
    assert pool.allocate(1) is None and pool.num_free == 0
    pool.free(a)
    assert pool.num_free == 4
    assert pool.allocate(5) is None and pool.num_free == 4  # refused whole, nothing taken
    assert sorted(pool.allocate(4)) == sorted(a)


def test_resize_grows_shrinks_and_refuses_without_change():
    pool = BlockPool(8)
    table = SequenceTable(pool, block_size=16)
    s = Sequence("ns", "a")
    assert table.resize(s, 1) and len(s.block_table) == 1
    assert table.resize(s, 16) and len(s.block_table) == 1
    assert table.resize(s, 17) and len(s.block_table) == 2
    assert table.blocks_missing(s, 200) == 11
    before = list(s.block_table)
    assert not table.resize(s, 200) and s.block_table == before and pool.num_free == 6
    assert table.resize(s, 5) and len(s.block_table) == 1 and pool.num_free == 7
    table.add(s)
    assert table.release("ns", "a") and pool.num_free == 8
    assert not table.release("ns", "a")


def test_namespaces_are_separate_and_no_block_is_shared():
    rng = random.Random(0)
    pool = BlockPool(64)
    table = SequenceTable(pool, block_size=8)
    seqs = {}
    for step in range(2000):
        key = (rng.choice(["x", "y"]), f"s{rng.randrange(12)}")
        s = table.get(*key)
        if s is None:
            s = Sequence(*key)
            if table.resize(s, rng.randint(1, 60)):
                table.add(s)
                seqs[key] = s
        elif rng.random() < 0.2:
            assert table.release(*key)
            del seqs[key]
        else:
            table.resize(s, rng.randint(1, 120))
        owned = [b for s in seqs.values() for b in s.block_table]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert len(owned) + pool.num_free == 64, "a block leaked"
        if step % 50 == 0:
            check_tensor_rows(table, seqs.values())


def check_tensor_rows(table: SequenceTable, live) -> None:
    """Each live sequence's row of the block-tables tensor holds its list then zeros; every other row is zero."""
    t = table.rows.block_tables
    rows = set()
    for s in live:
        assert s.table_row >= 0 and s.table_row not in rows, "a row is shared"
        rows.add(s.table_row)
        n = len(s.block_table)
        assert t[s.table_row, :n].tolist() == s.block_table and not t[s.table_row, n:].any()
    free = [r for r in range(t.shape[0]) if r not in rows]
    assert not t[free].any(), "a free row is not zero"


def test_block_tables_tensor_follows_resize_release_and_eviction():
    """The tensor rows mirror the lists through growth past the tensor's rows, shrinking, release and eviction."""
    rng = random.Random(1)
    pool = BlockPool(400)
    table = SequenceTable(pool, block_size=4, max_model_len=160)
    live = {}
    for step in range(3000):
        sid = f"s{rng.randrange(150)}"  # more sequences than the tensor's first 64 rows
        s = table.get("ns", sid)
        if s is None:
            s = Sequence("ns", sid, last_step=step)
            if table.resize(s, rng.randint(1, 12)):
                table.add(s)
                live[sid] = s
        elif rng.random() < 0.1:
            table.release("ns", sid)
            del live[sid]
        elif rng.random() < 0.05:
            if table.evict_idle(step + 1, sequences=3):
                live = {k: v for k, v in live.items() if table.get("ns", k) is not None}
        else:
            table.resize(s, rng.randint(1, 160 if rng.random() < 0.1 else 12))
        if step % 100 == 0:
            check_tensor_rows(table, live.values())
    check_tensor_rows(table, live.values())
    assert table.rows.block_tables.shape[0] >= 128  # it grew


def test_rows_grown_inside_a_step_can_be_released_outside_one():
    """A step (inference mode) may grow the tensor; Release and the leases free rows outside inference mode."""
    import torch

    pool = BlockPool(200)
    table = SequenceTable(pool, block_size=4, max_model_len=64)
    seqs = [Sequence("ns", f"s{i}") for i in range(100)]  # past the first 64 rows
    with torch.inference_mode():
        for s in seqs:
            assert table.resize(s, 3)
            table.add(s)
    for s in seqs[::2]:
        assert table.release("ns", s.sequence_id)
    check_tensor_rows(table, seqs[1::2])


def test_touch_batch_moves_each_known_sequence_to_the_end_in_order():
    """SequenceTable.touch_batch (every step's admission): the sequences returned in order (None for unknown ones), each
    known one made the most recently used in the order given, overall and in its namespace's order (lru_order), with
    last_used / last_step set; the others keep their place and their marks. Checked against a plain list model, with
    steps of a few sequences (the loop), of one namespace, of both, naming a sequence twice, and additions."""
    rng = random.Random(1)
    table = SequenceTable(BlockPool(256), block_size=8)
    keys = [(ns, f"s{i}") for ns in ("x", "y") for i in range(10)]
    for key in keys:
        s = Sequence(*key)
        assert table.resize(s, 9)
        table.add(s)
    order, marks = list(keys), {key: (0.0, 0) for key in keys}  # the model: LRU order, (last_used, last_step)
    for serial in range(1, 40):
        asked = rng.sample(keys + [("x", "gone"), ("z", "s1")], rng.randint(1, 12))
        if serial % 3 == 0:  # one namespace, every sequence known (touch_batch's path without a Python loop)
            asked = rng.sample(keys[:10], rng.randint(2, 10))
        if serial % 5 == 0:  # a sequence named twice: its last place counts
            asked = asked + asked[:1]
        got, rows = table.touch_batch([k[0] for k in asked], [k[1] for k in asked], float(serial), serial)
        assert [None if s is None else (s.namespace, s.sequence_id) for s in got] == \
            [k if k in marks else None for k in asked]
        assert rows.tolist() == [s.table_row for s in got if s is not None]
        for key in asked:
            if key in marks:
                order.remove(key)
                order.append(key)
                marks[key] = (float(serial), serial)
        if serial % 7 == 0:  # a new sequence is the most recently used
            key = ("y", f"new{serial}")
            s = Sequence(*key, last_used=float(serial), last_step=serial)
            assert table.resize(s, 9)
            table.add(s)
            keys.append(key)
            order.append(key)
            marks[key] = (float(serial), serial)
        lru = [(s.namespace, s.sequence_id) for s in table.lru_order()]
        assert lru == order
        assert {ns: [s.sequence_id for s in table.lru_order(ns)] for ns in ("x", "y")} == \
            {ns: [sid for n, sid in order if n == ns] for ns in ("x", "y")}
        assert [(s.last_used, s.last_step) for s in table.lru_order()] == [marks[k] for k in order]


def test_touch_batch_of_the_same_sequences_again_stays_true_across_drops_and_additions():
    """An engine sends the same batch step after step: touch_batch answers it again from its last lookup while no
    sequence was added or dropped (SequenceTable._membership). The answer must never be stale: a sequence of the batch
    released, evicted or re-added under the same id (a new row), or a new sequence added, and the next call looks up
    again; the marks (last_used / last_step / LRU order) are written on every call; the rows are read-only; a batch
    naming a sequence twice or an unknown one is looked up every time; distinct() knows the rows name no row twice."""
    import numpy as np
    import pytest

    table = SequenceTable(BlockPool(512), block_size=8)

    def add(sid):
        s = Sequence("x", sid)
        assert table.resize(s, 9)
        table.add(s)
        return s

    for i in range(40):
        add(f"s{i}")
    ids = [f"s{i}" for i in range(12)]

    def check(serial, asked=ids):
        # fresh string objects every call, as a parsed request brings
        got, rows = table.touch_batch(["x"] * len(asked), [str(bytes(a, "ascii"), "ascii") for a in asked],
                                      float(serial), serial)
        want = [table.get("x", a) for a in asked]
        assert got == want
        assert rows.tolist() == [s.table_row for s in want if s is not None]
        for s in want:
            if s is not None:
                assert (s.last_used, s.last_step) == (float(serial), serial)
        # the most recently used last: the known ones asked, each at its last place in the batch
        tail = list(dict.fromkeys(a for a in reversed(asked) if table.get("x", a) is not None))[::-1]
        assert [s.sequence_id for s in table.lru_order()][-len(tail):] == tail
        return rows

    first = check(1)
    assert check(2) is first  # the same answer again (nothing added or dropped)
    assert table.distinct(first)
    with pytest.raises(ValueError):
        first[0] = 99  # read-only: it is handed out again
    old_row = table.get("x", "s3").table_row
    assert table.release("x", "s3")
    rows = check(3)  # s3 is gone: None in its place, its row no longer among the rows
    assert table.get("x", "s3") is None and old_row not in rows.tolist() and len(rows) == 11
    add("s39b")  # another sequence's row taken, then s3 re-added under its id: a new object, maybe a new row
    s3 = add("s3")
    rows = check(4)
    assert rows[3] == s3.table_row
    assert check(5) is rows
    twice = ids + ids[:1]
    a, b = check(6, twice), check(7, twice)
    assert a is not b and not table.distinct(b)  # a sequence named twice: looked up every time
    assert np.array_equal(a, b)
    before = len(table)
    assert table.evict_idle(8, sequences=1)  # the least recently used idle sequence (not one of the batch)
    assert len(table) == before - 1
    rows = check(9)
    assert check(10) is rows


def test_step_state_lives_in_the_rows_and_survives_growth_and_drop():
    """A sequence's committed_len / last_drafts / last_drafts_base / predraft flag read back what was written, whether
    it holds a row or not; the row's columns hold them (what Proposer.step_batch reads as arrays), growth of the rows
    and of the drafts' width keeps them, a dropped sequence keeps them on the object, and a freed row is all zero.
    Checked against a plain dict model under random operations."""
    import numpy as np

    from drafter_service.engine.sequence_rows import STATE_COLUMNS

    rng = random.Random(3)
    table = SequenceTable(BlockPool(600), block_size=4, max_model_len=64)
    live, model, dropped = {}, {}, []
    for step in range(3000):
        sid = f"s{rng.randrange(200)}"
        s = table.get("ns", sid)
        op = rng.random()
        if s is None:
            s = Sequence("ns", sid)
            s.committed_len, s.last_drafts_base = rng.randrange(50), rng.randrange(50)  # (before it has a row)
            s.last_drafts = [rng.randrange(1000) for _ in range(rng.randrange(4))]
            if table.resize(s, rng.randint(1, 12)):
                table.add(s)
                live[sid] = s
                model[sid] = (s.committed_len, s.last_drafts_base, s.last_drafts, False)
        elif op < 0.1:
            table.release("ns", sid)
            dropped.append((live.pop(sid), model.pop(sid)))
        else:
            k = rng.choice([0, 1, 3, 5, 8, 12, 20])  # (past the first width of the drafts' column)
            s.committed_len, s.last_drafts_base = rng.randrange(60), rng.randrange(60)
            s.last_drafts = [rng.randrange(1000) for _ in range(k)]
            s.predraft = object() if rng.random() < 0.3 else None
            model[sid] = (s.committed_len, s.last_drafts_base, s.last_drafts, s.predraft is not None)
        if step % 100 == 0 or step == 2999:
            R = table.rows
            for sid, s in live.items():
                c, base, drafts, pre = model[sid]
                assert (s.committed_len, s.last_drafts_base, s.last_drafts, s.predraft is not None) == model[sid]
                r = s.table_row
                assert (R.committed_len[r], R.drafts_base[r], R.num_drafts[r], R.predrafting[r]) == \
                    (c, base, len(drafts), pre)
                assert R.drafts[r, : len(drafts)].tolist() == drafts and R.num_blocks[r] == len(s.block_table)
            for s, (c, base, drafts, _) in dropped:
                assert s.table_row == -1 and (s.committed_len, s.last_drafts_base, s.last_drafts) == (c, base, drafts)
            free = np.setdiff1d(np.arange(R.num_blocks.shape[0]), [s.table_row for s in live.values()])
            for name in STATE_COLUMNS:
                assert not getattr(R, name)[free].any(), f"a free row's {name} is not zero"
    assert table.rows.num_blocks.shape[0] >= 128 and table.rows.drafts.shape[1] >= 20  # both grew


def test_eviction_and_expiry_follow_the_lru_order_under_random_operations():
    """evict_idle (its candidate queue kept across steps) and expire against a plain list model of the LRU order:
    random steps of touches (one namespace or both, sequences named twice), new sequences, releases, evictions of
    blocks or sequences, of one namespace or any, some refused (not enough idle), and lease expiries. The queue is
    kept short (EVICTION_QUEUE_MIN 4) so that it runs out, is built again, and outlives steps often."""
    import pytest

    from drafter_service.engine import sequence as sequence_module

    rng = random.Random(7)
    mp = pytest.MonkeyPatch()
    mp.setattr(sequence_module, "EVICTION_QUEUE_MIN", 4)
    try:
        table = SequenceTable(BlockPool(4000), block_size=4, max_model_len=64,
                              limits=sequence_module.SequenceLimits(lease_s=30.0))
        order: list[tuple[str, str]] = []  # the model: least recently used first
        used: dict[tuple[str, str], tuple[float, int]] = {}  # key -> (last_used, last_step)
        next_id = 0

        def add(key, now, serial):
            s = Sequence(*key, last_used=now, last_step=serial)
            assert table.resize(s, rng.randint(1, 20))
            table.add(s)
            order.append(key)
            used[key] = (now, serial)

        for serial in range(1, 400):
            now = float(serial)
            if order and rng.random() < 0.8:  # the step's sequences: touched first
                asked = rng.sample(order, min(len(order), rng.randint(1, 12)))
                if rng.random() < 0.5:  # of one namespace
                    asked = [k for k in asked if k[0] == asked[0][0]]
                if rng.random() < 0.1:
                    asked = asked + asked[:1]
                table.touch_batch([k[0] for k in asked], [k[1] for k in asked], now, serial)
                for key in asked:
                    order.remove(key)
                    order.append(key)
                    used[key] = (now, serial)
            for _ in range(rng.randint(0, 3)):  # new sequences of the step
                next_id += 1
                add((rng.choice("xy"), f"s{next_id}"), now, serial)
            op = rng.random()
            if op < 0.4 and order:  # an eviction
                ns = rng.choice([None, "x", "y"])
                blocks, seqs = (rng.randint(1, 30), 0) if rng.random() < 0.5 else (0, rng.randint(1, 6))
                idle = [k for k in order if used[k][1] != serial and (ns is None or k[0] == ns)]
                victims, got = [], 0
                for key in idle:
                    if got >= blocks and len(victims) >= seqs:
                        break
                    victims.append(key)
                    got += len(table.get(*key).block_table)
                enough = got >= blocks and len(victims) >= seqs
                assert table.evict_idle(serial, blocks=blocks, sequences=seqs, namespace=ns) == enough
                if enough:
                    for key in victims:
                        order.remove(key)
                        del used[key]
                assert [(s.namespace, s.sequence_id) for s in table.lru_order()] == order
            elif op < 0.5 and order:  # a release
                key = rng.choice(order)
                assert table.release(*key)
                order.remove(key)
                del used[key]
            elif op < 0.55:  # the lease
                later = now + rng.choice([0.0, 10.0, 29.0, 31.0])
                gone = [k for k in order if later - used[k][0] >= 30.0]
                assert table.expire(later) == len(gone)
                for key in gone:
                    order.remove(key)
                    del used[key]
                due = min((used[k][0] for k in order), default=None)
                assert table.expiry_due(later) == (later + 30.0 if due is None else due + 30.0)
            assert len(table) == len(order)
        assert table.counters.evicted > 50 and table.counters.expired > 0
    finally:
        mp.undo()


def test_grow_rows_takes_what_a_resize_of_each_in_turn_takes():
    """SequenceTable.grow_rows (a step's growing sequences at once): the same block ids in the same rows as resize()
    of each sequence in turn, the same pool left, the namespaces' counts; a pool too short changes nothing, and a
    sequence past a row's width raises before a block is taken."""
    rng = random.Random(3)
    tables = [SequenceTable(BlockPool(400), block_size=4, max_model_len=256) for _ in range(2)]
    seqs = [[], []]
    for t, mine in zip(tables, seqs):
        for i in range(20):
            s = Sequence("x" if i % 3 else "y", f"s{i}")
            assert t.resize(s, 1 + (i * 7) % 13)
            t.add(s)
            mine.append(s)
    for _ in range(15):
        pick = sorted(rng.sample(range(20), rng.randint(1, 12)))
        more = [rng.randint(1, 4) for _ in pick]
        one, each = tables
        for i, n in zip(pick, more):  # one sequence at a time
            assert each.resize(seqs[1][i], (seqs[1][i].num_blocks + n) * 4)
        rows = np.array([seqs[0][i].table_row for i in pick], dtype=np.int64)
        have = one.rows.num_blocks[rows].copy()
        by_ns = {}
        for i, n in zip(pick, more):
            by_ns[seqs[0][i].namespace] = by_ns.get(seqs[0][i].namespace, 0) + n
        assert one.grow_rows(rows, have, np.array(more), by_ns)
        assert [s.block_table for s in seqs[0]] == [s.block_table for s in seqs[1]]
        assert list(one.pool._free) == list(each.pool._free)
        assert one._ns_blocks == each._ns_blocks
    check_tensor_rows(one, seqs[0])
    one = tables[0]
    rows = np.array([seqs[0][0].table_row], dtype=np.int64)
    have = one.rows.num_blocks[rows].copy()
    before = ([s.block_table for s in seqs[0]], list(one.pool._free), dict(one._ns_blocks))
    assert not one.grow_rows(rows, have, np.array([one.pool.num_free + 1]), {"y": one.pool.num_free + 1})
    assert before == ([s.block_table for s in seqs[0]], list(one.pool._free), dict(one._ns_blocks))
    with pytest.raises(ValueError, match="at most 64"):
        one.grow_rows(rows, have, 65 - have, {"y": int(65 - have[0])})
    assert before == ([s.block_table for s in seqs[0]], list(one.pool._free), dict(one._ns_blocks))
