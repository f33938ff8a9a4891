"""Block allocator and per-sequence block tables."""
import random

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
