"""parse_propose on random requests: both ways of checking token ids (python lists up to SMALL_CHECK_TOKENS, numpy
above) name the same first bad id, and good requests decode to exactly what the client packed; the list
encoders of small replies."""
import random

import pytest
import torch

from drafter_client import SequenceStep
from drafter_client.client import build_request
from drafter_client.protocol import pb
from drafter_service.transport.validation import SMALL_CHECK_TOKENS, Limits, RequestError, parse_propose
from drafter_client.protocol.wire import decode_tensor, encode_float32s, encode_int64s

W, V = 16, 1000
LIMITS = Limits(hidden_states_width=W, vocab_size=V, max_draft_tokens=8, max_request_tokens=4096,
                max_request_seqs=64)


def random_steps(rng: random.Random, n: int, total: int) -> list[SequenceStep]:
    cuts = sorted(rng.sample(range(1, total), n - 1)) if n > 1 else []
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, total])]
    return [SequenceStep(f"s{i}", rng.randrange(100), [rng.randrange(V) for _ in range(m)],
                         torch.randn(m, W).to(torch.bfloat16), rng.randrange(V), rng.randrange(6))
            for i, m in enumerate(sizes)]


def parse(steps):
    return parse_propose(pb.ProposeRequest.FromString(build_request("ns", steps).SerializeToString()), LIMITS)


@pytest.mark.parametrize("total", [1, 3, SMALL_CHECK_TOKENS, SMALL_CHECK_TOKENS + 1, 300])
def test_good_requests_decode_to_what_was_packed(total):
    rng = random.Random(total)
    for n in sorted({1, min(total, 2), min(total, 7)}):
        steps = random_steps(rng, n, total)
        got = parse(steps)
        assert [g.sequence_id for g in got] == [s.sequence_id for s in steps]
        for g, s in zip(got, steps):
            assert g.token_ids.tolist() == s.token_ids and g.token_ids.dtype == torch.int64
            assert torch.equal(g.hidden_states, s.hidden_states)
            assert (g.start_position, g.next_token, g.num_drafts) == (s.start_position, s.next_token, s.num_drafts)


@pytest.mark.parametrize("total", [2, SMALL_CHECK_TOKENS, SMALL_CHECK_TOKENS + 1, 300])
def test_the_first_bad_token_id_is_named_on_both_paths(total):
    rng = random.Random(1000 + total)
    for trial in range(6):
        steps = random_steps(rng, min(total, 3), total)
        flat = [t for s in steps for t in s.token_ids]
        bad_rows = sorted(rng.sample(range(total), min(total, rng.randint(1, 3))))
        for r in bad_rows:
            flat[r] = rng.choice([-1 - rng.randrange(5), V + rng.randrange(5)])
        it = iter(flat)
        for s in steps:
            s.token_ids = [next(it) for _ in s.token_ids]
        with pytest.raises(RequestError) as e:
            parse(steps)
        first = bad_rows[0]
        assert e.value.message == f"token_ids[{first}] = {flat[first]} is outside the vocabulary [0, {V})"


def test_list_encoders_match_the_tensor_encoding():
    ids = [0, 5, -1, 2**62, 128255]
    probs = [0.0, -1.5, 3.25e-8, float("-inf")]
    assert decode_tensor(encode_int64s(ids), "x", (pb.INT64,), 1).tolist() == ids
    assert decode_tensor(encode_float32s(probs), "x", (pb.FLOAT32,), 1).tolist() == torch.tensor(probs).tolist()
    assert decode_tensor(encode_int64s([]), "x", (pb.INT64,), 1).shape == (0,)


@pytest.mark.parametrize("seed", range(8))
def test_serialize_request_is_the_built_request(seed):
    """serialize_request writes large hidden states into the bytes directly: the drafter must parse exactly the
    message build_request makes, on random batches around the size where the direct copy starts."""
    from drafter_client.messages import DIRECT_STATES_MIN_BYTES, DirectRequest, serialize_request

    g = torch.Generator().manual_seed(seed)
    dtype = [torch.float32, torch.bfloat16, torch.float16][seed % 3]
    width = int(torch.randint(1, 700, (1,), generator=g))
    batch = int(torch.randint(1, 40, (1,), generator=g))
    steps = []
    for i in range(batch):
        m = int(torch.randint(1, 9, (1,), generator=g))
        steps.append(SequenceStep(f"s{i}", int(torch.randint(0, 50, (1,), generator=g)), list(range(m)),
                                  torch.randn(m, width, generator=g).to(dtype), 3, int(torch.randint(0, 6, (1,),
                                                                                                     generator=g))))
    packed = torch.cat([s.hidden_states for s in steps]) if seed % 2 else None
    built = build_request("ns", steps, packed, request_id=seed)
    raw = serialize_request("ns", steps, packed, request_id=seed)
    assert pb.ProposeRequest.FromString(bytes(raw)) == built
    assert len(raw) == built.ByteSize()
    big = sum(s.hidden_states.numel() for s in steps) * steps[0].hidden_states.element_size() >= DIRECT_STATES_MIN_BYTES
    assert isinstance(raw, DirectRequest) == big  # (the direct copy ran exactly where it should)
