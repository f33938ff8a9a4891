"""Sampling through the server: replayed steps give the same drafts; log-probs and top-N describe the q the draft
was drawn from (checked against the naive EAGLE-3 reference's logits); GetInfo tells the engine what to send."""
import asyncio

import pytest
import torch

from checkpoints import write_eagle3
from conftest import ServerThread, make_config
from drafter_client import DrafterClient, SequenceStep
from naive_eagle3 import NaiveEagle3


@pytest.fixture(scope="module")
def eagle3_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("e3s")
    head, target = write_eagle3(root / "model", seed=21, aux_layer_ids=[1, 3, 6])
    with ServerThread(make_config(head, target, root)) as server:
        yield server, NaiveEagle3(head, target)


def _prompt(naive, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, naive.vocab, (n + 1,), generator=g).tolist()
    return tokens, torch.randn(n, naive.width, generator=g)


def test_get_info_names_the_target_layers(eagle3_server):
    server, naive = eagle3_server

    async def run():
        async with DrafterClient(server.tcp) as c:
            return await c.get_info()

    info = asyncio.run(run())
    assert info.method == "eagle3"
    assert list(info.target_layer_ids) == [1, 3, 6]
    assert info.hidden_states_width == 3 * 64 == naive.width
    assert "[1, 3, 6]" in info.hidden_states_source and "output_hidden_states" in info.hidden_states_source
    assert info.vocab_size == 512 and info.draft_vocab_size == 200 and info.max_top_k_probs == 200
    assert not info.parallel_drafting


def test_replayed_step_gives_same_drafts_and_q_matches_reference(eagle3_server):
    server, naive = eagle3_server
    tokens, feats = _prompt(naive, 23, seed=5)
    T, N, k = 6.0, 6, 4  # a high temperature: the head's logits are sharp

    def step(p: int, **kw) -> SequenceStep:
        return SequenceStep("s", p, tokens[p:23], feats[p:23], tokens[23], k, temperature=T, seed=2**64 - 3,
                            return_logprobs=True, top_k_probs=N, **kw)

    async def run():
        async with DrafterClient(server.tcp, namespace="replay") as c:
            first = (await c.propose([step(0)])).sequences[0]
            again = (await c.propose([step(20)])).sequences[0]  # rolled back 3 positions and re-sent: same state
            await c.release(["s"])
            return first, again

    first, again = asyncio.run(run())
    assert first.ok and again.ok
    # the same drafts; q equal up to float rounding (the replay's batch has another shape)
    assert torch.equal(first.drafts, again.drafts) and torch.equal(first.top_k_ids, again.top_k_ids)
    torch.testing.assert_close(first.logprobs, again.logprobs)
    assert first.top_k_ids.shape == (k, N) and first.top_k_probs.shape == (k, N)
    # q at each position from the reference's logits: softmax over the top N of logits / T, target ids via d2t
    ids, hid = list(tokens[1:24]), feats.double() @ naive.w["fc.weight"].T
    for j in range(k):
        o = naive.forward(ids, hid)
        logits = naive.logits(o[-1])
        top = logits.topk(N)
        q = torch.softmax(top.values / T, 0)
        assert first.top_k_ids[j].tolist() == [naive.to_target(int(d)) for d in top.indices]
        torch.testing.assert_close(first.top_k_probs[j].double(), q, atol=1e-4, rtol=1e-4)
        d = int(first.drafts[j])
        assert d in first.top_k_ids[j].tolist()  # drawn from the truncated q
        assert abs(float(first.logprobs[j]) - float(q[first.top_k_ids[j].tolist().index(d)].log())) < 1e-4
        ids.append(d)
        hid = torch.cat([hid, o[-1:]])


def test_greedy_top_k_is_a_point_mass_and_rows_are_padded(eagle3_server):
    server, naive = eagle3_server
    tokens, feats = _prompt(naive, 9, seed=6)

    async def run():
        async with DrafterClient(server.tcp, namespace="greedy") as c:
            r = await c.propose([
                SequenceStep("a", 0, tokens[:9], feats, tokens[9], 3, top_k_probs=4, return_logprobs=True),
                SequenceStep("b", 0, tokens[:9], feats, tokens[9], 2, temperature=1.0, seed=1, top_k_probs=2),
                SequenceStep("c", 0, tokens[:9], feats, tokens[9], 2)])
            await c.release(["a", "b", "c"])
            return r

    r = asyncio.run(run())
    a, b, c = r.sequences
    assert a.drafts.tolist() == naive.drafts(tokens, feats, 3)
    assert a.top_k_probs[:, 0].tolist() == [1.0] * 3 and (a.top_k_probs[:, 1:] == 0).all()
    assert torch.equal(a.top_k_ids[:, 0], a.drafts) and a.logprobs.tolist() == [0.0] * 3
    # the request's N is 4: b's rows carry 2 ids then padding, c's rows are all padding
    assert (b.top_k_ids[:, 2:] == -1).all() and (b.top_k_probs[:, 2:] == 0).all()
    torch.testing.assert_close(b.top_k_probs[:, :2].sum(1), torch.ones(2))
    assert (c.top_k_ids == -1).all()
