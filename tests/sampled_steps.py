"""Sampling steps through the sampled decode steps of cuda_graphs.py against the eager decode loop (shared by the CPU
test of the static steps and the GPU test of their graphs)."""
import torch

from drafter_service.engine.step_io import StepInput
from drafter_service.runtime import max_top_k_probs


def assert_same_top_n(ids_a: torch.Tensor, probs_a: torch.Tensor, ids_b: torch.Tensor, probs_b: torch.Tensor) -> None:
    """Two [k, N] top-N replies describe the same q: per draft the same ids with the same probabilities (to rounding).
    Compared by id, not by place: two ids whose probabilities tie to rounding may come in either order (a padded
    batch's matmuls round the logits differently: seen with N = the whole 200-token draft vocabulary, two ids at
    q = 1.5387e-8)."""
    assert ids_a.shape == ids_b.shape
    order_a, order_b = ids_a.argsort(dim=1), ids_b.argsort(dim=1)
    assert torch.equal(ids_a.gather(1, order_a), ids_b.gather(1, order_b))
    torch.testing.assert_close(probs_b.gather(1, order_b), probs_a.gather(1, order_a), atol=1e-5, rtol=1e-4)


def check_sampled_steps(eager, static, num_seqs: int = 5, seed: int = 3, prompt_chunk: bool = False) -> None:
    """Runtimes `eager` (no sampled decode graphs) and `static` (DecodeGraphs with sampled steps) take the same
    prefill, then three sampling steps: temperatures above 0 beside greedy rows, log q for some, k mixed; the first
    without top-N (the width-0 steps), the second with N <= 16 (width 16), the third with N past 16 up to the cap
    (the cap's width). Both must give the same drafts, top-N ids and KV, log q and top-N probabilities to rounding.
    prompt_chunk: the third step also brings a new sequence's first prompt chunk (20 tokens, k = 0), as vLLM's
    chunked prefill sends it beside the others' decodes."""
    graphs = static.proposer.decode_graphs
    cap = max_top_k_probs(static.proposer.model)
    assert graphs.widths == [0, 16, cap]
    width_used = []
    replay = graphs._replay
    graphs._replay = lambda bs, width=None: (width_used.append(width), replay(bs, width))
    runs_before = graphs.sampled_steps_run
    W, vocab = static.limits.hidden_states_width, 100
    g = torch.Generator().manual_seed(seed)
    n = num_seqs
    pos = [12 + i for i in range(n)]

    def run(rt, steps):
        return rt.proposer.step([StepInput("sampled", *s[:6], **s[6]) for s in steps])

    first = [(f"q{i}", 0, torch.randint(0, vocab, (pos[i],), generator=g), torch.randn(pos[i], W, generator=g), 7, 0,
              {}) for i in range(n)]
    assert all(o.code == 0 for rt in (eager, static) for o in run(rt, first))
    # (temperature, log q, N) per sequence (cycled), for three steps: no top-N, N <= 16, N past 16
    settings = [
        [(0.8, True, 0), (0.0, False, 0), (1.3, False, 0), (0.5, True, 0), (0.0, True, 0)],
        [(0.8, True, 3), (0.0, False, 0), (1.3, False, 16), (0.5, True, 1), (0.0, True, 5)],
        [(0.8, False, 40), (0.7, True, 2), (0.0, False, 0), (2.0, True, cap), (1.0, False, 0)],
    ]
    for j, cycle in enumerate(settings):
        rows = [cycle[i % len(cycle)] for i in range(n)]
        ks = [[5, 2, 6, 1, 4][i % 5] if j != 1 else 3 for i in range(n)]
        steps = []
        for i, ((t, lp, top_n), k) in enumerate(zip(rows, ks)):
            m = 1 + (i + j) % 3
            steps.append((f"q{i}", pos[i], torch.randint(0, vocab, (m,), generator=g), torch.randn(m, W, generator=g),
                          int(torch.randint(0, vocab, (1,), generator=g)), k,
                          dict(temperature=t, seed=100 + i, return_logprobs=lp, top_k_probs=top_n)))
            pos[i] += m
        if prompt_chunk and j == 2:
            steps.append(("fresh", 0, torch.randint(0, vocab, (20,), generator=g), torch.randn(20, W, generator=g),
                          3, 0, dict(temperature=0.9, seed=5, top_k_probs=3)))
        width_used.clear()
        want, got = run(eager, steps), run(static, steps)
        assert set(width_used) == {[0, 16, cap][j]}, width_used
        if len(steps) > n:  # (the prompt chunk: no drafts, its KV written; compared below)
            assert want[n].code == got[n].code == 0 and want[n].drafts == got[n].drafts == []
        for i, (a, b) in enumerate(zip(want[:n], got[:n])):
            assert a.code == b.code == 0 and len(a.drafts) == ks[i], (a.message, b.message)
            assert a.drafts == b.drafts, (j, i)
            torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=1e-4)
            if rows[i][2] == 0:
                assert a.top_k_ids is None and b.top_k_ids is None
            else:
                assert b.top_k_ids.shape == (ks[i], rows[i][2])
                assert_same_top_n(a.top_k_ids, a.top_k_probs, b.top_k_ids, b.top_k_probs)
    assert graphs.sampled_steps_run - runs_before == 3
    torch.testing.assert_close(static.kv.kv, eager.kv.kv, atol=1e-4, rtol=1e-4)
