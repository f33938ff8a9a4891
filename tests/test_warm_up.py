"""runtime.warm_up (run on CUDA before health turns SERVING, so that the first real steps find the Triton kernels
compiled) leaves nothing behind: no sequence, every KV block free, no count in the metrics; and its steps all ran."""
import logging

from conftest import make_config
from drafter_service.runtime import build_runtime, warm_up


def test_warm_up_leaves_no_trace(tiny_model, tmp_path, caplog):
    rt = build_runtime(make_config(*tiny_model, tmp_path))
    with caplog.at_level(logging.INFO, logger="drafter_service.runtime"):
        warm_up(rt.proposer, rt.limits.hidden_states_width, rt.limits.max_draft_tokens)
    assert "warm-up steps ran" in caplog.text and "refused" not in caplog.text
    assert len(rt.proposer.table) == 0
    assert rt.kv.pool.num_free == rt.kv.num_blocks
    assert not rt.kv.kv.any()  # the pool's memory as at start: nothing the warm-up wrote is left
    assert list(rt.kv.pool._free) == list(range(rt.kv.num_blocks))  # and its free list in a new pool's order
    assert rt.metrics.steps == 0 and rt.metrics.sequence_steps == 0
    # pre-drafting passes ran (a pass compiles kernels of its own), and left no estimate or count behind
    # a pass, a hit, the pass after it; for 1 then 4 sequences; over short then long contexts
    assert "0 kernel variants, 8 pre-drafting passes, 10 hits)" in caplog.text  # (CPU: no Triton)
    pd = rt.proposer.predraft
    assert pd.counters.passes == 0 and pd.counters.hits == 0 and rt.metrics.predraft_counters is pd.counters
    assert not pd._pass_s and pd.window_s is None and not pd.recent_passes and not pd.has_work()


def test_a_warmed_up_drafter_holds_the_kv_of_one_that_was_not(tiny_model, tmp_path):
    """The warm-up's allocations and writes (its passes' scratch branches too) leave no trace in the KV of later
    steps: the same steps on a warmed-up drafter and on a fresh one give the same pools, block for block."""
    import torch
    from drafter_service.engine.step_io import StepInput

    warm = build_runtime(make_config(*tiny_model, tmp_path / "warm"))
    cold = build_runtime(make_config(*tiny_model, tmp_path / "cold"))
    warm_up(warm.proposer, warm.limits.hidden_states_width, warm.limits.max_draft_tokens)
    g = torch.Generator().manual_seed(3)
    width = warm.limits.hidden_states_width
    steps = [[StepInput("ns", f"q{i}", 0, torch.randint(0, 500, (20 + i,), generator=g), torch.randn(20 + i, width,
                                                                                                    generator=g), 7, 4)
              for i in range(3)]]
    steps.append([StepInput("ns", f"q{i}", 20 + i, torch.randint(0, 500, (2,), generator=g),
                            torch.randn(2, width, generator=g), 9, 4) for i in range(3)])
    for batch in steps:
        a, b = warm.proposer.step(batch), cold.proposer.step(batch)
        assert [o.drafts for o in a] == [o.drafts for o in b] and all(o.code == 0 for o in a)
    assert torch.equal(warm.kv.kv, cold.kv.kv)


def test_warm_up_fits_a_small_pool(tiny_model, tmp_path, caplog):
    """With a pool too small for the long-context round, the warm-up leaves that round out instead of being refused."""
    rt = build_runtime(make_config(*tiny_model, tmp_path, kv_cache_tokens=512, max_model_len=512))
    with caplog.at_level(logging.INFO, logger="drafter_service.runtime"):
        warm_up(rt.proposer, rt.limits.hidden_states_width, rt.limits.max_draft_tokens)
    assert "warm-up steps ran" in caplog.text and "refused" not in caplog.text
    passes = int(caplog.text.split(" pre-drafting passes")[0].rsplit(" ", 1)[1])
    assert 1 <= passes <= 4  # (the short round's, as the small pool lets it prepare; no long round)
    assert len(rt.proposer.table) == 0 and rt.kv.pool.num_free == rt.kv.num_blocks


def test_a_failing_pre_drafting_pass_does_not_stop_the_warm_up(tiny_model, tmp_path, caplog, monkeypatch):
    """The warm-up is best effort: a pass that raises is logged, its branches dropped, and the drafter starts."""
    rt = build_runtime(make_config(*tiny_model, tmp_path))

    def broken(should_stop):
        raise RuntimeError("a broken pass")

    monkeypatch.setattr(rt.proposer.predraft, "prepare", broken)
    with caplog.at_level(logging.INFO, logger="drafter_service.runtime"):
        warm_up(rt.proposer, rt.limits.hidden_states_width, rt.limits.max_draft_tokens)
    assert "warm-up pre-drafting pass failed" in caplog.text and "warm-up steps ran" in caplog.text
    assert len(rt.proposer.table) == 0 and rt.kv.pool.num_free == rt.kv.num_blocks
