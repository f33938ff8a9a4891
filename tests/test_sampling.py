"""Draft sampling (the kernels' gumbel_sample through ops, and sample_drafts): greedy at T = 0, Gumbel-max
reproducible per (seed, position), distribution = softmax(logits/T).

The statistical tests are deterministic (the noise is a hash of seed and position), so they cannot flake: each
draws S samples of one small-vocabulary distribution by varying the position and compares the histogram with
the expected q by Pearson's chi-square. Tolerance: the statistic must stay below the 1 - 1e-4 quantile of the
chi-square distribution with V - 1 degrees of freedom (a sampler that is off by a few percent on any token fails
by a wide margin at S = 40000), and the total-variation distance below 0.02.
"""
import pytest
import torch

from drafter_service.engine.sampling import gumbel_sample, sample_drafts, seed_to_int64

S = 40000
# 1 - 1e-4 quantiles of chi-square(df) (scipy.stats.chi2.ppf(0.9999, df))
CHI2_CRIT = {3: 21.108, 7: 29.878, 15: 42.579}


def _histogram(logits: torch.Tensor, temperature: float, seed: int, top_k: int = 0) -> torch.Tensor:
    V = logits.shape[0]
    rows = logits.expand(S, V)
    seed = seed_to_int64(seed)
    if top_k:
        out = sample_drafts(rows, torch.full((S,), temperature), torch.full((S,), seed, dtype=torch.int64),
                            torch.arange(S), torch.full((S,), top_k), want_logprobs=False)
        tok = out.tokens
    else:
        tok = gumbel_sample(rows, torch.full((S,), temperature), torch.full((S,), seed, dtype=torch.int64),
                                torch.arange(S))
    return torch.bincount(tok, minlength=V).double()


def _check(counts: torch.Tensor, q: torch.Tensor) -> None:
    support = q > 0
    assert counts[~support].sum() == 0, "sampled a token with probability 0"
    expected = q[support] * S
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    tv = float((counts / S - q).abs().sum() / 2)
    assert chi2 < CHI2_CRIT[df], f"chi-square {chi2:.1f} >= {CHI2_CRIT[df]} (df {df}); TV {tv:.4f}"
    assert tv < 0.02


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_gumbel_samples_follow_softmax_over_temperature(temperature):
    logits = torch.randn(8, generator=torch.Generator().manual_seed(3)) * 1.5
    counts = _histogram(logits, temperature, seed=1234)
    _check(counts, torch.softmax(logits.double() / temperature, 0))


def test_top_k_truncated_sampling_follows_renormalized_q():
    logits = torch.randn(16, generator=torch.Generator().manual_seed(4))
    T, N = 0.8, 4
    counts = _histogram(logits, T, seed=2**63 + 5, top_k=N)  # a seed above 2^63 (uint64 on the wire) too
    keep = logits.topk(N).indices
    q = torch.zeros(16, dtype=torch.float64)
    q[keep] = torch.softmax(logits[keep].double() / T, 0)
    _check(counts, q)


def test_greedy_at_temperature_zero_and_per_row_temperature():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g)
    T = torch.tensor([0.0, 1.0, 0.0, 2.0, 0.0, 0.5])
    out = gumbel_sample(logits, T, torch.arange(6), torch.arange(6) * 7)
    greedy = logits.argmax(-1)
    assert torch.equal(out[T == 0], greedy[T == 0])


def test_reproducible_per_seed_and_position_and_batch_independent():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(32, 100, generator=g)
    T = torch.full((32,), 1.0)
    seed = torch.randint(0, 2**62, (32,), generator=g)
    pos = torch.randint(0, 4096, (32,), generator=g)
    a = gumbel_sample(logits, T, seed, pos)
    assert torch.equal(a, gumbel_sample(logits, T, seed, pos))
    # the same row alone, or in a permuted batch, gets the same sample
    perm = torch.randperm(32, generator=g)
    assert torch.equal(a[perm], gumbel_sample(logits[perm], T[perm], seed[perm], pos[perm]))
    assert int(gumbel_sample(logits[5:6], T[5:6], seed[5:6], pos[5:6])) == int(a[5])
    # another seed or another position changes the draws (flat logits: every column equally likely)
    flat = torch.zeros(64, 1000)
    s0 = gumbel_sample(flat, torch.ones(64), torch.zeros(64, dtype=torch.int64), torch.arange(64))
    s1 = gumbel_sample(flat, torch.ones(64), torch.ones(64, dtype=torch.int64), torch.arange(64))
    assert (s0 != s1).float().mean() > 0.9
    assert len(set(s0.tolist())) > 50


def test_sample_drafts_reports_q_logprobs_and_padded_top_k():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 30, generator=g)
    T = torch.tensor([1.3, 0.0, 0.7, 1.0])
    top_k = torch.tensor([5, 3, 0, 30])
    out = sample_drafts(logits, T, torch.arange(4) + 9, torch.arange(4), top_k, want_logprobs=True)
    assert out.top_ids.shape == (4, 30) and out.top_probs.shape == (4, 30)
    # row 0: truncated to its top 5, q renormalized over them; the draft is among them
    keep = logits[0].topk(5).indices
    q0 = torch.softmax(logits[0, keep] / 1.3, 0)
    assert torch.equal(out.top_ids[0, :5], keep)
    torch.testing.assert_close(out.top_probs[0, :5], q0)
    assert (out.top_ids[0, 5:] == -1).all() and (out.top_probs[0, 5:] == 0).all()
    assert int(out.tokens[0]) in keep.tolist()
    assert abs(float(out.logprobs[0]) - float(q0[keep.tolist().index(int(out.tokens[0]))].log())) < 1e-5
    # row 1: greedy, q is the point mass on the draft
    assert int(out.tokens[1]) == int(logits[1].argmax())
    assert out.top_probs[1].tolist()[:3] == [1.0, 0.0, 0.0] and int(out.top_ids[1, 0]) == int(out.tokens[1])
    assert float(out.logprobs[1]) == 0.0
    # row 2: no top-N asked, full softmax; its top-N row is all padding
    assert (out.top_ids[2] == -1).all()
    lq = torch.log_softmax(logits[2] / 0.7, 0)[out.tokens[2]]
    assert abs(float(out.logprobs[2]) - float(lq)) < 1e-5
    # row 3: N = the whole vocabulary -> the full q, summing to 1
    assert abs(float(out.top_probs[3].sum()) - 1.0) < 1e-5


@pytest.mark.gpu
def test_gumbel_sample_same_on_cuda_and_cpu():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(16, 4000, generator=g)
    T = torch.rand(16, generator=g) + 0.2
    seed = torch.randint(0, 2**62, (16,), generator=g)
    pos = torch.randint(0, 10**6, (16,), generator=g)
    cpu = gumbel_sample(logits, T, seed, pos)
    gpu = gumbel_sample(logits.cuda(), T.cuda(), seed.cuda(), pos.cuda()).cpu()
    assert torch.equal(cpu, gpu)
