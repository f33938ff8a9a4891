"""argmax and Gumbel-max sampling: Triton kernels vs torch references.

Token ids must be identical (the Gumbel noise is the same Philox stream in both, scores compared in fp64);
logprobs within atol 1e-4 (fp32 online logsumexp vs torch.log_softmax).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: @triton.jit reads it when kernels are defined
triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from drafter_kernels.testing import DEVICE_DTYPES, INTERPRET, kernel_module, poisoned  # noqa: E402

sampling = kernel_module("sampling")


def tied_logits(num_rows, vocab_size, gen):
    """Small integer logits: many ties, including ties between chunks of the kernel's vocab loop."""
    logits = torch.randint(-3, 4, (num_rows, vocab_size), generator=gen).float()
    if vocab_size > 4000:
        logits[0, 3] = logits[0, 4000] = 10.0  # tie across chunks: the first one wins
        logits[1, 4001] = 11.0
    return logits


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("num_rows,vocab_size", [(1, 1), (3, 7), (4, 1000), (2, 5003)])
def test_argmax_matches_reference_with_ties(device, dtype, num_rows, vocab_size):
    gen = torch.Generator().manual_seed(vocab_size)
    for logits in (tied_logits(num_rows, vocab_size, gen), torch.randn(num_rows, vocab_size, generator=gen)):
        logits = logits.to(device=device, dtype=dtype)
        expected = sampling.argmax_ref(logits, out=poisoned((num_rows,), torch.int64, device))
        actual = sampling.argmax_triton(logits, out=poisoned((num_rows,), torch.int64, device))
        assert torch.equal(actual, expected)
        # torch.argmax's tie rule, checked independently: the lowest id holding the maximum.
        first_max = (logits == logits.max(dim=-1, keepdim=True).values).float().argmax(dim=-1)
        assert torch.equal(expected, first_max)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("vocab_size", [5, 1000, 4099])
def test_gumbel_sample_matches_reference(device, dtype, vocab_size):
    gen = torch.Generator().manual_seed(vocab_size)
    num_rows = 6
    logits = (torch.randn(num_rows, vocab_size, generator=gen) * 2).to(device=device, dtype=dtype)
    temperature = torch.tensor([0.0, 1.0, 0.7, 2.0, 0.0, 1.5], device=device)
    seed = torch.tensor([1, 2, 3, -5, 2**40 + 7, 12345678901234], device=device)
    position = torch.tensor([0, 5, 2**33 + 1, 7, 8, 100], device=device)

    def run(fn):
        return fn(logits, temperature, seed, position, return_logprobs=True,
                  out=poisoned((num_rows,), torch.int64, device),
                  out_logprobs=poisoned((num_rows,), torch.float32, device))

    expected_ids, expected_logprobs = run(sampling.gumbel_sample_ref)
    actual_ids, actual_logprobs = run(sampling.gumbel_sample_triton)
    assert torch.equal(actual_ids, expected_ids)
    assert not expected_logprobs.isnan().any()
    torch.testing.assert_close(actual_logprobs, expected_logprobs, atol=1e-4, rtol=1e-5)
    # Temperature 0 rows are greedy; their logprob is log_softmax(logits) at the argmax.
    greedy = temperature == 0
    assert torch.equal(expected_ids[greedy], logits[greedy].argmax(-1))
    torch.testing.assert_close(expected_logprobs[greedy],
                               torch.log_softmax(logits[greedy].float(), -1).max(-1).values)
    # Replaying the step draws the same tokens; without logprobs too.
    assert torch.equal(sampling.gumbel_sample_triton(logits, temperature, seed, position), expected_ids)


# Two-stage (chunked) reductions with the chunking forced: BLOCK_V 16, chunks of 48 ids (3 tiles), so chunk
# boundaries sit at multiples of 48 and the vocab's last chunk is partial.
CHUNKED = dict(block_v=16, chunk_size=48)


def chunk_boundary_logits(num_rows, vocab_size, gen):
    """Small integer logits (ties everywhere) with hand-placed maxima across the chunk boundaries of CHUNKED."""
    logits = torch.randint(-3, 4, (num_rows, vocab_size), generator=gen).float()
    special = [
        ([47, 48], 9.0),  # last id of chunk 0 and first of chunk 1: 47
        ([48, 95, 96, vocab_size - 1], 9.0),  # first of chunk 1 wins over later chunks
        ([vocab_size - 1], 9.0),  # only in the partial last chunk
        ([31, 32, 200], 9.0),  # tile boundary inside chunk 0, and a later chunk
        ([], 0.0),  # handled below: a constant row -> id 0
    ]
    for row, (ids, value) in enumerate(special[:num_rows]):
        logits[row, [i for i in ids if i < vocab_size]] = value
    if num_rows > 4:
        logits[4] = 1.0
    if num_rows > 5:
        logits[5] = float("-inf")  # all -inf: torch.argmax picks 0
    return logits


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("num_rows,vocab_size", [(1, 1000), (33, 1000), (6, 47), (6, 49), (7, 300)])
def test_argmax_chunked_ties_at_chunk_boundaries(device, dtype, num_rows, vocab_size):
    gen = torch.Generator().manual_seed(num_rows * vocab_size)
    logits = chunk_boundary_logits(num_rows, vocab_size, gen).to(device=device, dtype=dtype)
    expected = sampling.argmax_ref(logits)
    if vocab_size > 200:
        assert expected[:4].tolist() == [47, 48, vocab_size - 1, 31][:num_rows]
    actual = sampling._argmax_launch(logits, poisoned((num_rows,), torch.int64, device), **CHUNKED)
    assert torch.equal(actual, expected)
    assert torch.equal(sampling.argmax_triton(logits, out=poisoned((num_rows,), torch.int64, device)), expected)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("num_rows", [1, 3])
def test_argmax_llama3_vocab_default_chunking(device, dtype, num_rows):
    vocab_size = 128256  # not a multiple of the 1024-wide tiles
    gen = torch.Generator().manual_seed(num_rows)
    logits = torch.randn(num_rows, vocab_size, generator=gen)
    block_v, chunk_size = sampling.vocab_launch_config(num_rows, vocab_size)
    assert vocab_size % chunk_size != 0 and vocab_size // chunk_size > 1
    logits[0, chunk_size - 1] = logits[0, chunk_size] = 50.0  # tie across the first chunk boundary
    logits[-1, vocab_size - 1] = 60.0  # maximum at the very last id
    logits = logits.to(device=device, dtype=dtype)
    expected = sampling.argmax_ref(logits)
    actual = sampling.argmax_triton(logits, out=poisoned((num_rows,), torch.int64, device))
    assert torch.equal(actual, expected)
    assert expected[0] == (chunk_size - 1 if num_rows > 1 else vocab_size - 1)


def test_vocab_launch_config_from_shapes_only():
    config = sampling.vocab_launch_config
    block_v, chunk_size = config(1, 128256)
    assert (block_v, chunk_size) == (1024, 1024)  # 126 programs of one tile each for one row
    block_v, chunk_size = config(32, 128256)
    assert 32 * -(-128256 // chunk_size) >= 3 * sampling.DEFAULT_SM_COUNT  # about 4 programs per SM
    assert config(1024, 128256)[1] >= 128256  # enough rows: one chunk per row, a single kernel
    assert config(3, 7) == (8, 8)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("num_rows,vocab_size,chunking", [
    (7, 1000, dict(block_v=64, chunk_size=128)),  # 8 chunks of 2 tiles, the last one partial
    (6, 130, dict(block_v=16, chunk_size=16)),  # one tile per chunk
    (1, 128256, None),  # the launcher's own chunking at the Llama-3 vocab
])
def test_gumbel_sample_chunked_matches_reference(device, dtype, num_rows, vocab_size, chunking):
    gen = torch.Generator().manual_seed(vocab_size + num_rows)
    logits = torch.randn(num_rows, vocab_size, generator=gen) * 2
    logits[0] = torch.randint(-3, 4, (vocab_size,), generator=gen).float()  # greedy row with ties
    logits[0, [47, 48]] = 9.0
    logits = logits.to(device=device, dtype=dtype)
    temperature = torch.tensor([0.0, 1.0, 0.7, 2.0, 0.0, 1.5] * 6, device=device)[:num_rows]
    seed = torch.arange(num_rows, device=device) * 7919 - 3
    position = torch.arange(num_rows, device=device) + 2**32 - 2

    def run(fn, **extra):
        return fn(logits, temperature, seed, position, return_logprobs=True,
                  out=poisoned((num_rows,), torch.int64, device),
                  out_logprobs=poisoned((num_rows,), torch.float32, device), **extra)

    expected_ids, expected_logprobs = run(sampling.gumbel_sample_ref)
    if chunking is None:
        actual_ids, actual_logprobs = run(sampling.gumbel_sample_triton)
        without_logprobs = actual_ids  # (the interpreter is slow at this size; the chunked cases check it)
    else:
        actual_ids = poisoned((num_rows,), torch.int64, device)
        actual_logprobs = poisoned((num_rows,), torch.float32, device)
        sampling._gumbel_sample_launch(logits, temperature, seed, position, True, actual_ids, actual_logprobs,
                                       **chunking)
        without_logprobs = poisoned((num_rows,), torch.int64, device)
        sampling._gumbel_sample_launch(logits, temperature, seed, position, False, without_logprobs, None,
                                       **chunking)
    assert int(expected_ids[0]) == 47
    assert torch.equal(actual_ids, expected_ids)
    assert torch.equal(without_logprobs, expected_ids)
    torch.testing.assert_close(actual_logprobs, expected_logprobs, atol=1e-4, rtol=1e-5)


def test_reference_samples_follow_softmax():
    # 3000 draws of a 4-token vocabulary at distinct positions: frequencies within 4 sigma of softmax(logits / T).
    num_draws, temperature = 3000, 0.8
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5]).repeat(num_draws, 1)
    tokens = sampling.gumbel_sample_ref(logits, torch.full((num_draws,), temperature),
                                        torch.full((num_draws,), 42), torch.arange(num_draws))
    probs = torch.softmax(logits[0] / temperature, -1)
    freqs = torch.bincount(tokens, minlength=4).float() / num_draws
    sigma = (probs * (1 - probs) / num_draws).sqrt()
    assert ((freqs - probs).abs() < 4 * sigma).all(), (freqs, probs)
    # Different seeds give different streams.
    other = sampling.gumbel_sample_ref(logits, torch.full((num_draws,), temperature),
                                       torch.full((num_draws,), 43), torch.arange(num_draws))
    assert (other != tokens).float().mean() > 0.3


@triton.jit
def _triton_philox_first_word(out_ptr, seed, position_lo, position_hi, N: tl.constexpr):
    ids = tl.arange(0, N).to(tl.uint32)
    zero = tl.zeros_like(ids)
    words = tl.philox(seed, ids, zero, zero + position_lo, zero + position_hi)
    tl.store(out_ptr + tl.arange(0, N), words[0])


@pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="needs a Triton backend")
def test_reference_philox_equals_triton_philox():
    # Our torch Philox against triton's own tl.philox (same key/counter layout): an independent implementation.
    device = "cpu" if INTERPRET else "cuda"
    seed, position = 2**40 + 7, 2**33 + 1
    words = torch.empty(64, dtype=torch.int32, device=device)
    _triton_philox_first_word[(1,)](words, seed, position & 0xFFFFFFFF, position >> 32, N=64)
    expected_uniform = ((words.long().cpu() & 0xFFFFFFFF).double() + 0.5) * 2.0**-32
    uniform = sampling.philox_uniform_ref(torch.tensor([seed]), torch.tensor([position]), 64)[0]
    torch.testing.assert_close(uniform, expected_uniform, atol=0, rtol=0)
