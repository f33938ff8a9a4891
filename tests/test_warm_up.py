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
    assert rt.metrics.steps == 0 and rt.metrics.sequence_steps == 0
    # pre-drafting passes ran (a pass compiles kernels of its own), and left no estimate or count behind
    assert "(4 pre-drafting passes, 5 hits)" in caplog.text  # (a pass, a hit, the pass after it; for 1 then 4)
    pd = rt.proposer.predraft
    assert pd.counters.passes == 0 and pd.counters.hits == 0 and rt.metrics.predraft_counters is pd.counters
    assert not pd._pass_s and pd.window_s is None and not pd.recent_passes and not pd.has_work()
