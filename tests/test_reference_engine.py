"""The reference engine with the bundled models (models/target + models/eagle1) and an in-process sidecar.

- greedy speculative decoding is token-for-token plain greedy decoding of the target (HF generate, one prompt at a
  time), for a batch of prompts of different lengths, k = 1, 3, 5 (the smallest top-1 / top-2 logit gap along these
  paths is 1.7e-3, far above fp32 rounding across batch shapes); eos stops a sequence;
- speculative sampling is exact: verify_sampling on synthetic distributions (every position, the bonus, a greedy
  and a non-greedy drafter), and end to end the first two sampled tokens after a fixed prefix follow the target's
  exact distribution (chi-square, p > 0.001; plain sampling passes the same test);
- the shipped EAGLE-1 and EAGLE-3 heads keep their acceptance: mean acceptance length >= ACCEPTANCE_FLOOR at k = 3 on the
  held-out-like prompts (docs/demo.md gives the measured value).
"""
import pathlib
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from conftest import ServerThread, make_config
from drafter_client import DrafterClient
from drafter_client.benchmarks.prompts import DEMO, HELDOUT_LIKE
from drafter_client.engine.reference_engine import ReferenceEngine, SpecConfig
from drafter_client.engine.target import TargetModel
from drafter_client.engine.verify import point_mass, verify_greedy, verify_sampling

MODELS = pathlib.Path(__file__).resolve().parent.parent / "models"
# k = 3, greedy, HELDOUT_LIKE, 64 new tokens, CPU fp32 (docs/demo.md states these floors and the measured values)
ACCEPTANCE_FLOOR = {"eagle1": 3.0, "eagle3": 3.0}  # measured 3.35 and 3.37 (2026-11-21)
P_VALUE_MIN = 1e-3


@pytest.fixture(scope="module")
def bundled_server(tmp_path_factory):
    cfg = make_config(MODELS / "eagle1", MODELS / "target", tmp_path_factory.mktemp("engine"))
    with ServerThread(cfg) as s:
        yield s


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return TargetModel.load(str(MODELS / "target"))


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(MODELS / "target" / "tokenizer.json"))


@pytest.fixture(scope="module")
def greedy_prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(t).ids for t in [*DEMO, HELDOUT_LIKE[1]]]  # 9, 3, 9 and 83 tokens


@pytest.fixture(scope="module")
def hf_greedy(target, greedy_prompts) -> list[list[int]]:
    """The oracle: transformers' own greedy generate, one prompt at a time (no padding, no drafts)."""
    out = []
    for p in greedy_prompts:
        ids = target.model.generate(torch.tensor([p]), max_new_tokens=40, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)
        out.append(ids[0, len(p):].tolist())
    return out


def chi_square_p_value(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit; bins of expected count < 5 are merged into one (when non-empty)."""
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum()[None]]).double()
    exp = torch.cat([expected[~small], expected[small].sum()[None]]).double()
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


@pytest.mark.parametrize("k", [1, 3, 5])
async def test_greedy_is_plain_greedy_decoding(bundled_server, target, greedy_prompts, hf_greedy, k):
    async with DrafterClient(bundled_server.uds, namespace=f"greedy-{k}") as drafter:
        engine = ReferenceEngine(target, drafter, await drafter.get_info())
        result = await engine.generate(greedy_prompts, SpecConfig(max_new_tokens=40, num_drafts=k))
        plain = await engine.generate_plain(greedy_prompts, SpecConfig(max_new_tokens=40))
    assert plain.tokens == hf_greedy
    assert result.tokens == hf_greedy
    acc = result.acceptance
    assert acc.num_accepted_tokens > 0 and result.target_forwards < plain.target_forwards
    assert acc.accepted_sent_back == acc.drafter_counted_accepted  # the drafter counted what the engine accepted
    assert len(acc.per_position_acceptance) == k
    assert acc.mean_acceptance_length == pytest.approx(1 + sum(acc.per_position_acceptance))
    # everything released
    free, total = bundled_server.call(lambda: (bundled_server.server.runtime.kv.pool.num_free,
                                               bundled_server.server.runtime.kv.num_blocks))
    assert free == total


async def test_greedy_with_predrafting_is_plain_greedy_decoding(bundled_server, target, greedy_prompts, hf_greedy):
    """Pre-drafting on (docs/predraft.md): the same tokens; the drafter counts acceptance on hits too; every block,
    branch blocks included, is free at the end. (Whether passes fit between this engine's steps depends on the
    machine: the fit check is off here so that they run, stopped or not; test_predraft.py checks the hits.)"""
    pd = bundled_server.server.runtime.proposer.predraft
    pd._fits = lambda n: True
    try:
        async with DrafterClient(bundled_server.uds, namespace="predraft") as drafter:
            engine = ReferenceEngine(target, drafter, await drafter.get_info())
            result = await engine.generate(greedy_prompts, SpecConfig(max_new_tokens=40, num_drafts=3,
                                                                      predraft_branches=8))
    finally:
        del pd._fits
    assert result.tokens == hf_greedy
    acc = result.acceptance
    assert acc.accepted_sent_back == acc.drafter_counted_accepted
    assert 0 <= acc.predrafted_steps <= acc.answered_steps and acc.answered_steps > 0
    assert pd.counters.passes + pd.counters.passes_stopped > 0
    free, total = bundled_server.call(lambda: (bundled_server.server.runtime.kv.pool.num_free,
                                               bundled_server.server.runtime.kv.num_blocks))
    assert free == total


async def test_eos_stops_a_sequence(bundled_server, target, greedy_prompts, hf_greedy):
    eos = hf_greedy[0][5]  # a token the first prompt's greedy continuation emits at step 6
    async with DrafterClient(bundled_server.uds, namespace="eos") as drafter:
        engine = ReferenceEngine(target, drafter, await drafter.get_info())
        result = await engine.generate(greedy_prompts, SpecConfig(max_new_tokens=40, num_drafts=3,
                                                                  eos_token_id=eos))
    for got, ref in zip(result.tokens, hf_greedy):
        assert got == (ref[: ref.index(eos) + 1] if eos in ref else ref)
    assert len(result.tokens[0]) <= 6


@pytest.mark.parametrize("greedy_drafter", [True, False])
def test_verify_sampling_is_exact_on_synthetic_distributions(greedy_drafter):
    """Committed token i (given the earlier ones were the drafts) follows the target's p_i at every position,
    the bonus included, for a point-mass drafter and for a drafter with a full distribution q."""
    g = torch.Generator().manual_seed(0)
    V, k, n = 6, 2, 12000
    logits = torch.randn(k + 1, V, generator=g) * 1.5
    p = torch.softmax(logits, -1)
    q = torch.softmax(torch.randn(k, V, generator=g), -1)
    draws = []
    for _ in range(n):
        if greedy_drafter:
            drafts = logits[:k].argmax(-1) if torch.rand(1, generator=g) < 0.5 else torch.randint(V, (k,),
                                                                                                   generator=g)
            a, toks = verify_sampling(logits, drafts, 1.0, g)
        else:
            drafts = torch.stack([torch.multinomial(q[i], 1, generator=g)[0] for i in range(k)])
            a, toks = verify_sampling(logits, drafts, 1.0, g, draft_probs=q)
        assert toks[:a] == drafts[:a].tolist() and len(toks) == a + 1
        draws.append((drafts.tolist(), toks))
    for i in range(k + 1):
        # token i is defined when tokens 0..i-1 were the drafts 0..i-1 (the sequence went on past them)
        reached = [t[i] for d, t in draws if len(t) > i and t[:i] == d[:i]]
        counts = torch.bincount(torch.tensor(reached), minlength=V)
        assert len(reached) > 500, i
        assert chi_square_p_value(counts, p[i] * len(reached)) > P_VALUE_MIN, (i, counts, p[i])


def test_verify_greedy():
    logits = torch.full((4, 8), -1.0)
    logits[0, 3] = logits[1, 5] = logits[2, 1] = logits[3, 7] = 1.0
    assert verify_greedy(logits, torch.tensor([3, 5, 2])) == (2, [3, 5, 1])
    assert verify_greedy(logits, torch.tensor([3, 5, 1])) == (3, [3, 5, 1, 7])
    assert verify_greedy(logits, torch.tensor([0, 5, 1])) == (0, [3])
    assert point_mass(torch.tensor([2]), 4).tolist() == [[0, 0, 1, 0]]


async def test_sampling_matches_the_target_distribution(bundled_server, target, tokenizer):
    """400 two-token continuations of one prefix, sampled speculatively (k = 3, T = 1) as two batches of 200,
    against the exact joint p(t1) p(t2 | t1) computed from the target's logits. With the shipped models the prefix
    makes t1 nearly certain (p 0.992) and the greedy draft for t2 has target probability ~0.42, so both branches
    (accept; reject and resample) are exercised and the test sees the rejection rule: resampling from p instead of
    norm(max(0, p - q)) fails it. (Re-pick the prefix if the models are retrained: the guard below says so.)"""
    prefix = tokenizer.encode("class OrderedDict(dict):\n\n    def __reversed__(self):").ids
    with torch.inference_mode():
        p1 = torch.softmax(target.model(torch.tensor([prefix])).logits[0, -1], -1)
        first = (p1 >= 1e-3).nonzero().flatten()  # the t1 that matter; the rest is the last bin
        rows = torch.cat([torch.tensor([prefix] * first.numel()), first[:, None]], dim=1)
        p2 = torch.softmax(target.model(rows).logits[:, -1], -1)
    joint = p1[first, None] * p2  # [len(first), V]
    cfg = SpecConfig(max_new_tokens=2, num_drafts=3, temperature=1.0)
    async with DrafterClient(bundled_server.uds, namespace="sampling") as drafter:
        engine = ReferenceEngine(target, drafter, await drafter.get_info())
        spec = [await engine.generate([prefix] * 200, replace(cfg, seed=s)) for s in (1, 2)]
        plain = [await engine.generate_plain([prefix] * 200, replace(cfg, seed=s)) for s in (1, 2)]
    first_position = sum(r.acceptance.accepted_per_position[0] for r in spec) / (len(spec) * 200)
    assert 0.2 < first_position < 0.9, first_position  # both branches (accept; reject and resample) are exercised
    index = {t: i for i, t in enumerate(first.tolist())}
    for name, runs in (("speculative", spec), ("plain", plain)):
        samples = [t for r in runs for t in r.tokens]
        counts = torch.zeros(joint.numel() + 1)
        for t1, t2 in samples:
            counts[index[t1] * joint.size(1) + t2 if t1 in index else -1] += 1
        expected = torch.cat([joint.flatten(), (1 - joint.sum()).clamp(min=0)[None]]) * len(samples)
        assert chi_square_p_value(counts, expected) > P_VALUE_MIN, name


@pytest.mark.parametrize("head", ["eagle1", "eagle3"])
async def test_shipped_heads_stay_above_their_acceptance_floor(head, bundled_server, target, tokenizer, tmp_path):
    prompts = [tokenizer.encode(t).ids for t in HELDOUT_LIKE]

    async def measure(uds: str) -> float:
        async with DrafterClient(uds, namespace=f"floor-{head}") as drafter:
            engine = ReferenceEngine(target, drafter, await drafter.get_info())
            result = await engine.generate(prompts, SpecConfig(max_new_tokens=64, num_drafts=3))
        return result.acceptance.mean_acceptance_length

    if head == "eagle1":
        value = await measure(bundled_server.uds)
    else:
        with ServerThread(make_config(MODELS / "eagle3", MODELS / "target", tmp_path)) as s:
            value = await measure(s.uds)
    assert value >= ACCEPTANCE_FLOOR[head], (head, value)


async def test_engine_refuses_bad_settings(bundled_server, target):
    async with DrafterClient(bundled_server.uds, namespace="bad") as drafter:
        info = await drafter.get_info()
        engine = ReferenceEngine(target, drafter, info)
        with pytest.raises(ValueError, match="num_drafts must be in"):
            await engine.generate([[1, 2, 3]], SpecConfig(num_drafts=info.max_draft_tokens + 1))
        with pytest.raises(ValueError, match="exceed the model length"):
            await engine.generate([[1] * 2000], SpecConfig(max_new_tokens=64))
        with pytest.raises(ValueError, match="is empty"):
            await engine.generate([[1], []], SpecConfig())
    wide = SimpleNamespace(hidden_states_width=3 * target.hidden_size, hidden_states_source="three layers",
                           target_layer_ids=[], vocab_size=target.vocab_size)
    with pytest.raises(ValueError, match="hidden states 768 wide"):
        ReferenceEngine(target, drafter, wide)
