"""prepare_inputs_padded and prepare_next_token_padded: Triton kernels vs torch references and worked examples."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: @triton.jit reads it when kernels are defined
pytest.importorskip("triton")

from drafter_kernels.testing import DEVICES, POISON_INT, kernel_module, poisoned  # noqa: E402

inputs_padded = kernel_module("prepare_inputs_padded")
next_token_padded = kernel_module("prepare_next_token_padded")


def run_prepare_inputs(fn, cu_num_draft, valid_count, query_start_loc, device):
    num_requests = cu_num_draft.shape[0]
    token_indices = poisoned((num_requests + 1,), torch.int32, device)  # one slot past the batch stays poisoned
    num_rejected = poisoned((num_requests + 1,), torch.int32, device)
    fn(cu_num_draft, valid_count, query_start_loc, token_indices[:num_requests], num_rejected[:num_requests])
    return token_indices, num_rejected


@pytest.mark.parametrize("device", DEVICES)
def test_prepare_inputs_padded_worked_example(device):
    # Drafts per request [3, 0, 2]; valid sampled (1 + accepted) [2, 1, 3]; query lens [4, 1, 3].
    args = [torch.tensor(v, dtype=torch.int32, device=device) for v in ([3, 3, 5], [2, 1, 3], [0, 4, 5, 8])]
    for fn in (inputs_padded.prepare_inputs_padded_ref, inputs_padded.prepare_inputs_padded_triton):
        token_indices, num_rejected = run_prepare_inputs(fn, *args, device)
        assert num_rejected.tolist() == [2, 0, 0, POISON_INT]
        assert token_indices.tolist() == [1, 4, 7, POISON_INT]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_requests", [1, 7, 1500])  # 1500: several programs
def test_prepare_inputs_padded_matches_reference(device, num_requests):
    gen = torch.Generator().manual_seed(num_requests)
    num_draft = torch.randint(0, 5, (num_requests,), generator=gen)
    valid_count = torch.minimum(torch.randint(1, 6, (num_requests,), generator=gen), num_draft + 1)
    query_lens = num_draft + 1 + torch.randint(0, 3, (num_requests,), generator=gen) * (num_draft == 0)
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.long), query_lens.cumsum(0)])
    args = [t.to(device=device, dtype=torch.int32) for t in (num_draft.cumsum(0), valid_count, query_start_loc)]
    expected = run_prepare_inputs(inputs_padded.prepare_inputs_padded_ref, *args, device)
    actual = run_prepare_inputs(inputs_padded.prepare_inputs_padded_triton, *args, device)
    for e, a in zip(expected, actual):
        assert torch.equal(a, e)
        assert (e[:num_requests] != POISON_INT).all() and e[num_requests] == POISON_INT


def run_next_token(fn, sampled, discard, backup, vocab_size, device):
    num_requests = sampled.shape[0]
    next_ids = poisoned((num_requests + 1,), torch.int64, device)
    valid_count = poisoned((num_requests + 1,), torch.int32, device)
    fn(sampled, discard, backup, vocab_size, next_ids[:num_requests], valid_count[:num_requests])
    return next_ids, valid_count


@pytest.mark.parametrize("device", DEVICES)
def test_prepare_next_token_padded_worked_example(device):
    sampled = torch.tensor([[5, 6, -1, -1], [-1, -1, -1, -1], [7, 8, 9, 10], [3, 4, -1, -1], [1, 50, -1, -1]],
                           device=device)
    discard = torch.tensor([False, False, False, True, False], device=device)
    backup = torch.tensor([100, 101, 102, 103, 104], device=device)
    for fn in (next_token_padded.prepare_next_token_padded_ref, next_token_padded.prepare_next_token_padded_triton):
        next_ids, valid_count = run_next_token(fn, sampled, discard, backup, 50, device)  # 50 is out of vocab
        assert next_ids.tolist() == [6, 101, 10, 103, 1, POISON_INT]
        assert valid_count.tolist() == [2, 0, 4, 0, 1, POISON_INT]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_requests,num_columns", [(1, 1), (9, 4), (300, 6)])
def test_prepare_next_token_padded_matches_reference(device, num_requests, num_columns):
    gen = torch.Generator().manual_seed(num_requests * num_columns)
    vocab_size = 1000
    sampled = torch.randint(0, vocab_size + 5, (num_requests, num_columns + 2), generator=gen)[:, :num_columns]
    num_accepted = torch.randint(0, num_columns + 1, (num_requests,), generator=gen)
    sampled[torch.arange(num_columns)[None, :] >= num_accepted[:, None]] = -1
    discard = torch.rand(num_requests, generator=gen) < 0.2
    backup = torch.randint(0, vocab_size, (num_requests,), generator=gen)
    args = [t.to(device) for t in (sampled, discard, backup)]  # sampled is a strided view (row stride != S)
    expected = run_next_token(next_token_padded.prepare_next_token_padded_ref, *args[:3], vocab_size, device)
    actual = run_next_token(next_token_padded.prepare_next_token_padded_triton, *args[:3], vocab_size, device)
    for e, a in zip(expected, actual):
        assert torch.equal(a, e)
        assert (e[:num_requests] != POISON_INT).all() and e[num_requests] == POISON_INT
