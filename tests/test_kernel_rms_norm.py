"""rms_norm: Triton kernel vs torch reference, with and without the fused residual add, and with rows gathered from
a table (the embedding gather fused into its norm).

Tolerances: fp32 atol = rtol = 1e-5; bf16 relative norm error < 1e-2. The residual sum is compared bit-exactly
(both round x + residual to the activation dtype once).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: @triton.jit reads it when kernels are defined
pytest.importorskip("triton")

from drafter_kernels.testing import DEVICE_DTYPES, assert_matches, kernel_module, poisoned  # noqa: E402

rms_norm = kernel_module("rms_norm")


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("num_rows,hidden_size", [(1, 64), (5, 100), (3, 4096), (17, 33)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(device, dtype, num_rows, hidden_size, with_residual):
    gen = torch.Generator().manual_seed(num_rows * hidden_size)
    x = (torch.randn(num_rows, hidden_size, generator=gen) * 3).to(device=device, dtype=dtype)
    weight = torch.randn(hidden_size, generator=gen).to(device=device, dtype=dtype)
    residual = torch.randn(num_rows, hidden_size, generator=gen).to(device=device, dtype=dtype) if with_residual else None
    eps = 1e-6

    def run(fn):
        out = poisoned(x.shape, dtype, device)
        residual_out = poisoned(x.shape, dtype, device) if with_residual else None
        return fn(x, weight, eps, residual, out=out, residual_out=residual_out)

    expected_out, expected_residual = run(rms_norm.rms_norm_ref)
    actual_out, actual_residual = run(rms_norm.rms_norm_triton)
    assert not expected_out.isnan().any()  # every element written
    assert_matches(actual_out, expected_out, atol=1e-5, rtol=1e-5)
    if with_residual:
        assert torch.equal(actual_residual, expected_residual)
        assert torch.equal(expected_residual, x + residual)
    else:
        assert actual_residual is None and expected_residual is None


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES[:1])
def test_rms_norm_allocates_outputs_when_not_given(device, dtype):
    x, residual, weight = torch.randn(4, 48), torch.randn(4, 48), torch.rand(48)
    expected = rms_norm.rms_norm_ref(x, weight, 1e-5, residual)
    actual = rms_norm.rms_norm_triton(x, weight, 1e-5, residual)
    torch.testing.assert_close(actual[0], expected[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(actual[1], expected[1])
    # The reference itself: unit RMS after normalisation with weight 1.
    normed, _ = rms_norm.rms_norm_ref(x, torch.ones(48), 0.0)
    torch.testing.assert_close(normed.pow(2).mean(-1), torch.ones(4))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("num_rows,vocab,hidden_size", [(1, 50, 64), (7, 300, 100), (5, 1000, 4096)])
def test_rms_norm_of_gathered_rows_matches_reference(device, dtype, num_rows, vocab, hidden_size):
    """rows: row t normalises table[rows[t]] (repeats and the table's first and last rows included), written into a
    column slice of a wider buffer (as EAGLE-3 writes the first half of its attention input); exactly the norm of
    the gathered rows."""
    gen = torch.Generator().manual_seed(vocab + num_rows)
    table = (torch.randn(vocab, hidden_size, generator=gen) * 2).to(device=device, dtype=dtype)
    weight = torch.randn(hidden_size, generator=gen).to(device=device, dtype=dtype)
    rows = torch.randint(0, vocab, (num_rows,), generator=gen)
    rows[0] = vocab - 1
    if num_rows > 2:
        rows[1], rows[2] = 0, rows[0]
    rows = rows.to(device)

    def run(fn):
        wide = poisoned((num_rows, 2 * hidden_size), dtype, device)
        fn(table, weight, 1e-6, out=wide[:, :hidden_size], rows=rows)
        return wide

    expected, actual = run(rms_norm.rms_norm_ref), run(rms_norm.rms_norm_triton)
    assert not expected[:, :hidden_size].isnan().any()
    assert_matches(actual[:, :hidden_size], expected[:, :hidden_size], atol=1e-5, rtol=1e-5)
    assert actual[:, hidden_size:].isnan().all()  # the other half untouched
    gathered, _ = rms_norm.rms_norm_triton(table[rows], weight, 1e-6)
    assert torch.equal(actual[:, :hidden_size], gathered)  # the same kernel on gathered rows: bit for bit
    fresh, none = rms_norm.rms_norm_triton(table, weight, 1e-6, rows=rows)
    assert fresh.shape == (num_rows, hidden_size) and none is None and torch.equal(fresh, gathered)
    # rows as a strided column of a 2-D tensor (pre-drafting's forced tokens) and as int32
    columns = torch.stack([rows, torch.zeros_like(rows)], dim=1)
    assert torch.equal(rms_norm.rms_norm_triton(table, weight, 1e-6, rows=columns[:, 0])[0], gathered)
    assert torch.equal(rms_norm.rms_norm_triton(table, weight, 1e-6, rows=rows.to(torch.int32))[0], gathered)
