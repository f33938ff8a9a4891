"""Every Triton kernel compiles for the GPU (sm_90, Hopper) even on a machine without one.

The interpreter tests check what the kernels compute but not that they compile. Run as a script (in a subprocess,
with TRITON_INTERPRET unset), this file calls every launcher with small tensors in each dtype and constexpr
variant the package uses, intercepts the launch, and runs triton.compile for a CUDA sm_90 target instead
(PTX -> cubin with the ptxas bundled in the triton wheel). On a CUDA machine the `gpu` tests compile for real, so
the check is skipped there.
"""
import os
import subprocess
import sys

import pytest
import torch

TARGET_ARCH = 90


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gpu tests compile the kernels for real on this machine")
def test_every_kernel_compiles_for_sm90():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when unset
    result = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "compiled 82 kernel variants" in result.stdout, result.stdout[-3000:]


def cross_compile_all() -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from drafter_kernels import (copy_expand_inputs, draft_step, kv_write, build_first_step, paged_attention,
                                 prepare_inputs_padded, prepare_next_token_padded, rms_norm, rope, sampling,
                                 shift_and_cache, silu_and_mul, mask_finished_rows, store_draft_step)

    type_names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int64: "i64", torch.int32: "i32",
                  torch.bool: "i1", torch.float64: "fp64"}
    num_compiled = 0

    class CompileInsteadOfLaunch:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                nonlocal num_compiled
                options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
                values = dict(zip([p.name for p in self.kernel.params], args)) | kwargs
                signature, constexprs, attrs = {}, {}, {}
                for index, param in enumerate(self.kernel.params):
                    value = values[param.name]
                    if param.is_constexpr:
                        signature[param.name], constexprs[param.name] = "constexpr", value
                    elif isinstance(value, torch.Tensor):
                        signature[param.name] = "*" + type_names[value.dtype]
                        attrs[(index,)] = [["tt.divisibility", 16]]  # like the JIT's 16-byte alignment specialization
                    elif isinstance(value, bool):
                        signature[param.name] = "i1"
                    elif isinstance(value, int):
                        signature[param.name] = "i32" if -2**31 <= value < 2**31 else "i64"
                        if value % 16 == 0 and value != 0:
                            attrs[(index,)] = [["tt.divisibility", 16]]
                    else:
                        signature[param.name] = "fp32"
                source = ASTSource(fn=self.kernel, signature=signature, constexprs=constexprs, attrs=attrs)
                compiled = triton.compile(source, target=GPUTarget("cuda", TARGET_ARCH, 32), options=options)
                assert len(compiled.asm["cubin"]) > 0
                num_compiled += 1
            return launch

    modules = (copy_expand_inputs, draft_step, kv_write, build_first_step, paged_attention, prepare_inputs_padded,
               prepare_next_token_padded, rms_norm, rope, sampling, shift_and_cache, silu_and_mul, mask_finished_rows,
               store_draft_step)
    for module in modules:
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction) and name.endswith("_kernel"):
                setattr(module, name, CompileInsteadOfLaunch(value))

    def zeros(*shape, dtype=torch.int64):
        return torch.zeros(*shape, dtype=dtype)

    for dtype in (torch.float32, torch.bfloat16):
        key, cache = zeros(9, 2, 80, dtype=dtype), zeros(4, 16, 2, 80, dtype=dtype)
        kv_write.write_kv_triton(key, key, cache, cache.clone(), zeros(9))
        q, block_tables = zeros(9, 8, 80, dtype=dtype), zeros(2, 4, dtype=torch.int32)
        seq_lens, query_start_loc = zeros(2, dtype=torch.int32), zeros(3, dtype=torch.int32)
        for block_size in (16, 32):
            cache = zeros(4, block_size, 2, 80, dtype=dtype)
            for max_query_len in (5, 1, None):
                paged_attention.paged_attention_triton(q, cache, cache, block_tables, seq_lens, query_start_loc, 0.1,
                                                       max_query_len=max_query_len)
        # split-K (decode and short prefill: kernel + reduce), Llama-3-8B shape, 1024-position block tables
        q_llama, cache_llama = zeros(9, 32, 128, dtype=dtype), zeros(4, 16, 8, 128, dtype=dtype)
        for max_query_len in (1, 3):
            paged_attention.paged_attention_triton(q_llama, cache_llama, cache_llama, zeros(2, 64, dtype=torch.int32),
                                                   seq_lens, query_start_loc, 0.1, max_query_len=max_query_len)
        x, weight = zeros(9, 4096, dtype=dtype), zeros(4096, dtype=dtype)
        rms_norm.rms_norm_triton(x, weight, 1e-6)
        rms_norm.rms_norm_triton(x, weight, 1e-6, x.clone())
        rms_norm.rms_norm_triton(x[:, :100], weight[:100].contiguous(), 1e-6, x[:, :100])
        rms_norm.rms_norm_triton(x, weight, 1e-6, out=zeros(9, 8192, dtype=dtype)[:, :4096], rows=zeros(9))  # EAGLE-3's
        rope.apply_rope_triton(q, key, zeros(9), zeros(64, 80, dtype=torch.float32))
        silu_and_mul.silu_and_mul_triton(zeros(9, 28672, dtype=dtype))
        mask_finished_rows.mask_finished_rows_triton(zeros(4, dtype=torch.int32), zeros(4), zeros(4, dtype=torch.int32),
                                                     zeros(4), zeros(4, 4096, dtype=dtype))
        for d2t in (zeros(100), None):  # EAGLE-3 (a draft vocabulary) and EAGLE-1
            store_draft_step.store_draft_step_triton(zeros(4), d2t, zeros(4, 4096, dtype=dtype), zeros(1), zeros(4),
                                                     zeros(4, 4096, dtype=dtype), zeros(4, 6),
                                                     zeros(4, 6, 4096, dtype=dtype))
        temperature, seed = zeros(3, dtype=torch.float32), zeros(3)
        for vocab_size in (5003, 100):  # two-stage (chunks + reduce) and single-chunk
            logits = zeros(3, vocab_size, dtype=dtype)
            sampling.argmax_triton(logits)
            sampling.gumbel_sample_triton(logits, temperature, seed, seed)
            sampling.gumbel_sample_triton(logits, temperature, seed, seed, return_logprobs=True)
        shift_and_cache.shift_and_cache_triton(zeros(20, 300, dtype=dtype), zeros(20, 300, dtype=dtype),
                                               zeros(3, 4, 300, dtype=dtype), *[zeros(2)] * 6)
    for shift in (True, False):
        copy_expand_inputs.copy_and_expand_inputs_triton(
            zeros(10, dtype=torch.int32), zeros(10), zeros(2), zeros(3, dtype=torch.int32),
            zeros(2, dtype=torch.int32), zeros(14, dtype=torch.int32), zeros(14), zeros(14, dtype=torch.bool),
            zeros(14, dtype=torch.bool), zeros(6, dtype=torch.int32), zeros(10, dtype=torch.int32), 0, 99, 3, shift)
    int32s = [zeros(n, dtype=torch.int32) for n in (5, 5, 6, 5, 5)]
    prepare_inputs_padded.prepare_inputs_padded_triton(*int32s)
    for num_columns in (4, 1):
        prepare_next_token_padded.prepare_next_token_padded_triton(
            zeros(5, num_columns), zeros(5, dtype=torch.bool), zeros(5), 1000, zeros(5), zeros(5, dtype=torch.int32))
    for column in (None, zeros(1)):  # (the graphs' decode step advances its draft column too)
        draft_step.advance_draft_step_triton(zeros(5), zeros(5, 3, dtype=torch.int32), zeros(5, dtype=torch.int32), 16,
                                             100, zeros(5), zeros(8), column, 15)
    for dtype in (torch.float32, torch.bfloat16):
        i32 = [zeros(n, dtype=torch.int32) for n in (2, 4, 5, 4, 4, 12, 20)]
        build_first_step.build_first_step_rows_triton(
            *i32, zeros(12, 100, dtype=dtype), 16, 3, zeros(4), zeros(4, dtype=torch.int32),
            zeros(4, 5, dtype=torch.int32), zeros(4, dtype=torch.int32), zeros(12), zeros(12), zeros(12),
            zeros(12, 100, dtype=dtype), zeros(1))
    for dtype in (torch.int64, torch.int32):
        shift_and_cache.shift_and_cache_triton(zeros(20, dtype=dtype), zeros(20, dtype=dtype),
                                               zeros(3, 4, dtype=dtype), *[zeros(2)] * 6)
    return num_compiled


if __name__ == "__main__":
    print(f"compiled {cross_compile_all()} kernel variants for sm_{TARGET_ARCH}")
