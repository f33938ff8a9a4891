"""The Triton kernels that run eagerly (pre-drafting passes, steps without CUDA graphs) must not compile again as the
context grows or the batch changes: a kernel compiles once per set of constexpr values and per specialization of
its integer arguments (== 1, divisible by 16) that are not do_not_specialize, and a compile takes 0.2-0.5 s on the
step thread. An H200 run of eager passes at batch 1 stalled 0.4-0.5 s every ~64 tokens of context (the attention
split count was a constexpr taking every value up to 128).

Each launcher runs with the kernel replaced by a recorder of that compile key, over contexts of 1-4000 tokens and
batches of 1-300 sequences; the number of distinct keys must stay small."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from drafter_kernels.testing import kernel_module  # noqa: E402

attention = kernel_module("paged_attention")
sampling = kernel_module("sampling")
draft_step = kernel_module("draft_step")


class CompileKeys:
    """Stands in for a @triton.jit kernel: kernel[grid](*args, **kwargs) records the key Triton compiles under."""

    def __init__(self, kernel):
        self.kernel = kernel
        fn = getattr(kernel, "fn", kernel)  # (InterpretedFunction under TRITON_INTERPRET, JITFunction otherwise)
        import inspect
        self.names = list(inspect.signature(fn).parameters)
        options = getattr(kernel, "kwargs", None) or {}
        if "do_not_specialize" in options:
            self.free = set(options["do_not_specialize"] or [])
        else:
            self.free = {p.name for p in kernel.params if p.do_not_specialize}
        self.keys: set = set()

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            kwargs.pop("num_warps", None)
            kwargs.pop("num_stages", None)
            values = dict(zip(self.names, args)) | kwargs
            key = []
            for name in self.names:
                v = values[name]
                if isinstance(v, int) and not isinstance(v, bool) and name not in self.free and name not in kwargs:
                    key.append((name, v == 1, v % 16 == 0))  # how the JIT specializes an int argument
                elif name in kwargs:
                    key.append((name, v))  # a constexpr
            self.keys.add(tuple(key))
        return launch


@pytest.fixture
def recorded(monkeypatch):
    def record(module, name):
        rec = CompileKeys(getattr(module, name))
        monkeypatch.setattr(module, name, rec)
        return rec
    return record


def test_attention_compiles_a_few_variants_as_contexts_and_batches_grow(recorded):
    main = recorded(attention, "_paged_attention_kernel")
    reduce = recorded(attention, "_paged_attention_reduce_kernel")
    block_size, hq, hkv, d = 16, 32, 8, 128
    k_cache = torch.empty(8, block_size, hkv, d, dtype=torch.bfloat16)
    for batch in (1, 2, 3, 8, 17, 64, 130, 300):
        for blocks in (1, 2, 5, 16, 17, 33, 64, 65, 100, 129, 250):  # table widths: contexts of 16-4000 tokens
            for q_len in (1, 2, 3, 6):
                tables = torch.zeros(batch, blocks, dtype=torch.int32)
                q = torch.empty(batch * q_len, hq, d, dtype=torch.bfloat16)
                attention._paged_attention_launch(
                    q, k_cache, k_cache, tables, torch.ones(batch, dtype=torch.int32),
                    torch.arange(batch + 1, dtype=torch.int32) * q_len, 0.1, q_len, torch.empty_like(q))
    # the split count took ~100 values here when it was a constexpr; now: SPLIT x BLOCK_M x BLOCK_H choices
    assert len(main.keys) <= 8, sorted(main.keys)
    assert len(reduce.keys) <= 8, sorted(reduce.keys)  # BLOCK_S: a power of two


def test_argmax_compiles_a_few_variants_across_batch_sizes(recorded):
    main = recorded(sampling, "_argmax_kernel")
    reduce = recorded(sampling, "_argmax_reduce_kernel")
    for rows in list(range(1, 70)) + [100, 128, 255, 256, 300, 512, 1024]:
        for vocab in (32000, 128256):
            logits = torch.empty(rows, vocab)
            sampling._argmax_launch(logits, torch.empty(rows, dtype=torch.int64),
                                    *sampling.vocab_launch_config(rows, vocab, 132))
    assert len(main.keys) <= 12, sorted(main.keys)
    assert len(reduce.keys) <= 24, sorted(reduce.keys)


def test_draft_step_compiles_a_few_variants_across_batch_sizes(recorded):
    main = recorded(draft_step, "_advance_draft_step_kernel")
    for rows in range(1, 300, 7):
        for blocks in (1, 16, 17, 64, 65):
            draft_step.advance_draft_step_triton(
                torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, blocks, dtype=torch.int32),
                torch.ones(rows, dtype=torch.int32), 16, 4096,
                torch.empty(rows, dtype=torch.int64), torch.empty(rows + 3, dtype=torch.int64))
    assert len(main.keys) <= 10, sorted(main.keys)  # BLOCK: a power of two up to 1024 (36 keys before)
