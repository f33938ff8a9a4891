"""apply_rope: Triton kernel vs torch reference (neox rotate-half, Llama-3 scaled cache for one case).

Tolerances: fp32 atol = rtol = 1e-5; bf16 relative norm error < 1e-2.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: @triton.jit reads it when kernels are defined
pytest.importorskip("triton")

from drafter_kernels.testing import DEVICE_DTYPES, assert_matches, kernel_module, poisoned  # noqa: E402

rope = kernel_module("rope")

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize(
    "num_tokens,num_q_heads,num_kv_heads,head_dim,scaling",
    [(7, 4, 1, 64, None), (5, 3, 3, 80, None), (1, 8, 2, 128, LLAMA3_SCALING), (11, 5, 5, 36, LLAMA3_SCALING)],
)
def test_apply_rope_matches_reference(device, dtype, num_tokens, num_q_heads, num_kv_heads, head_dim, scaling):
    gen = torch.Generator().manual_seed(num_tokens + head_dim)
    max_positions = 300
    cos_sin_cache = rope.build_cos_sin_cache(max_positions, head_dim, 10000.0, scaling).to(device)
    # q and k as non-contiguous views of one fused QKV output.
    qkv = torch.randn(num_tokens, num_q_heads + 2 * num_kv_heads, head_dim, generator=gen).to(device=device,
                                                                                               dtype=dtype)
    q, k = qkv[:, :num_q_heads], qkv[:, num_q_heads:num_q_heads + num_kv_heads]
    positions = torch.randint(0, max_positions, (num_tokens,), generator=gen).to(device)

    def run(fn):
        return fn(q, k, positions, cos_sin_cache,
                  q_out=poisoned(q.shape, dtype, device), k_out=poisoned(k.shape, dtype, device))

    expected_q, expected_k = run(rope.apply_rope_ref)
    actual_q, actual_k = run(rope.apply_rope_triton)
    assert not expected_q.isnan().any() and not expected_k.isnan().any()
    assert_matches(actual_q, expected_q, atol=1e-5, rtol=1e-5)
    assert_matches(actual_k, expected_k, atol=1e-5, rtol=1e-5)


def test_reference_rotation_preserves_norm_and_is_identity_at_position_zero():
    cache = rope.build_cos_sin_cache(16, 8, 10000.0, None)
    q, k = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    q_rot, k_rot = rope.apply_rope_ref(q, k, torch.tensor([0, 5, 15]), cache)
    torch.testing.assert_close(q_rot[0], q[0])
    torch.testing.assert_close(q_rot.norm(dim=-1), q.norm(dim=-1))
    torch.testing.assert_close(k_rot.norm(dim=-1), k.norm(dim=-1))
