"""The Triton kernels that run eagerly (pre-drafting passes, steps without CUDA graphs) must not compile again as the
context grows or the batch changes: a kernel compiles once per set of constexpr values and per specialization of
its integer arguments (== 1, divisible by 16) that are not do_not_specialize, and a compile takes 0.2-0.5 s on the
step thread. An H200 run of eager passes at batch 1 stalled 0.4-0.5 s every ~64 tokens of context (the attention
split count was a constexpr taking every value up to 128).

Each launcher runs with the kernel replaced by a recorder of that compile key (constexprs, the specializations of
integer arguments, and each pointer's 16-byte alignment), over contexts of 1-4000 tokens and batches of 1-300
sequences; the number of distinct keys must stay small."""
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
build_first_step = kernel_module("build_first_step")
build_packed = kernel_module("build_packed_first_step")


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
                elif isinstance(v, torch.Tensor) and name not in self.free:
                    key.append((name, v.data_ptr() % 16 == 0))  # and a pointer: 16-byte aligned or not
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
                torch.empty(rows, dtype=torch.int64), torch.empty(rows + 3, dtype=torch.int64),
                torch.zeros(1, dtype=torch.int64), rows % 17)  # (the graphs' variant: a draft column, any limit)
    assert len(main.keys) <= 10, sorted(main.keys)  # BLOCK: a power of two up to 1024 (36 keys before)


def test_build_first_step_compiles_one_variant_across_batches_and_widths(recorded):
    """It is captured in every first-step graph (one per padded batch and M) and replayed whatever the step's B and
    table width (read from the record): no M, block size or state width may compile another variant."""
    main = recorded(build_first_step, "_build_first_step_rows_kernel")
    i32 = dict(dtype=torch.int32)
    for bs in (1, 2, 16, 48, 256):
        for M in (1, 2, 3, 8):
            for block_size in (1, 16, 32):
                for width in (64, 4096, 12288):
                    R = bs * M
                    build_first_step.build_first_step_rows_triton(
                        torch.zeros(2, **i32), torch.zeros(bs, **i32), torch.zeros(bs + 1, **i32),
                        torch.zeros(bs, **i32), torch.zeros(bs, **i32), torch.zeros(R, **i32),
                        torch.zeros(bs * 65, **i32), torch.zeros(R, width, dtype=torch.bfloat16), block_size, M,
                        torch.empty(bs, dtype=torch.int64), torch.empty(bs, **i32), torch.empty(bs, 65, **i32),
                        torch.empty(bs, **i32), torch.empty(R, dtype=torch.int64), torch.empty(R, dtype=torch.int64),
                        torch.empty(R, dtype=torch.int64), torch.empty(R, width, dtype=torch.bfloat16),
                        torch.empty(1, dtype=torch.int64))
    assert len(main.keys) == 1, sorted(main.keys)


def test_build_packed_first_step_compiles_one_variant_across_batches_and_rows(recorded):
    """Captured in every packed first-step graph (one per padded batch and row bucket) and replayed whatever the
    step's B, T and table width: no size may compile another variant."""
    main = recorded(build_packed, "_build_packed_first_step_rows_kernel")
    i32 = dict(dtype=torch.int32)
    for bs in (1, 2, 16, 48, 256):
        for R in (32, 64, 384, 2048):
            for block_size in (1, 16, 32):
                i64 = dict(dtype=torch.int64)
                build_packed.build_packed_first_step_rows_triton(
                    torch.zeros(2, **i32), torch.zeros(bs, **i32), torch.zeros(bs + 1, **i32), torch.zeros(bs, **i32),
                    torch.zeros(bs, **i32), torch.zeros(R, **i32), torch.zeros(bs * 65, **i32), block_size,
                    torch.empty(bs, **i64), torch.empty(bs, **i32), torch.empty(bs, 65, **i32), torch.empty(bs, **i32),
                    torch.empty(bs + 1, **i32), torch.empty(bs, **i64), torch.empty(R, **i64), torch.empty(R, **i64),
                    torch.empty(R, **i64), torch.empty(1, **i64))
    assert len(main.keys) == 1, sorted(main.keys)


@pytest.mark.parametrize("heads,kv_heads,head_dim,dtype", [(32, 8, 128, torch.bfloat16), (32, 8, 128, torch.float32),
                                                           (8, 4, 64, torch.float32), (16, 16, 64, torch.bfloat16)])
def test_compile_variants_cover_every_attention_launch(recorded, heads, kv_heads, head_dim, dtype):
    """The warm-up's attention launches (compile_variants) compile every key that steps of any batch, query length
    and context up to max_model_len reach: after them nothing compiles inside a step."""
    main = recorded(attention, "_paged_attention_kernel")
    reduce = recorded(attention, "_paged_attention_reduce_kernel")
    block_size, max_model_len = 16, 4096
    k_cache = torch.empty(8, block_size, kv_heads, head_dim, dtype=dtype)
    launches = attention.compile_variants(k_cache, k_cache, heads, max_model_len, dtype)
    assert launches <= 20
    warm = (set(main.keys), set(reduce.keys))
    for batch in (1, 2, 3, 8, 17, 64, 130, 300):
        for blocks in (1, 2, 5, 16, 17, 33, 64, 65, 100, 129, 256):  # contexts of 16-4096 tokens
            for q_len in (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 33, 40):
                tables = torch.zeros(batch, blocks, dtype=torch.int32)
                q = torch.empty(batch * q_len, heads, head_dim, dtype=dtype)
                attention._paged_attention_launch(
                    q, k_cache, k_cache, tables, torch.ones(batch, dtype=torch.int32),
                    torch.arange(batch + 1, dtype=torch.int32) * q_len, 0.1, q_len, torch.empty_like(q))
                # one prompt of q_len * 8 rows beside decodes (a sequence joining): the packed grid from batch 2
                rows = torch.ones(batch, dtype=torch.int32)
                rows[0] = q_len * 8
                q = torch.empty(int(rows.sum()), heads, head_dim, dtype=dtype)
                qsl = torch.cat([torch.zeros(1, dtype=torch.int32), rows.cumsum(0).to(torch.int32)])
                attention._paged_attention_launch(q, k_cache, k_cache, tables, torch.ones(batch, dtype=torch.int32),
                                                  qsl, 0.1, q_len * 8, torch.empty_like(q))
    packed = [key for key in main.keys if ("PACKED_GRID", True) in key]
    assert packed, "no launch above took the packed grid"
    assert set(main.keys) == warm[0], sorted(set(main.keys) - warm[0])
    assert set(reduce.keys) == warm[1], sorted(set(reduce.keys) - warm[1])


@pytest.mark.parametrize("vocab", [2048, 32000, 128256])
def test_compile_argmax_variants_cover_every_batch_size(recorded, vocab):
    main = recorded(sampling, "_argmax_kernel")
    reduce = recorded(sampling, "_argmax_reduce_kernel")
    launches = sampling.compile_argmax_variants(vocab, torch.bfloat16, torch.device("cpu"))
    assert launches <= 16
    warm = (set(main.keys), set(reduce.keys))
    for rows in list(range(1, 70)) + [100, 128, 255, 256, 300, 512, 527, 528, 529, 1024, 4096]:
        logits = torch.empty(rows, vocab, dtype=torch.bfloat16)
        sampling.argmax_triton(logits)
    assert set(main.keys) == warm[0], sorted(set(main.keys) - warm[0])
    assert set(reduce.keys) == warm[1], sorted(set(reduce.keys) - warm[1])


KERNEL_MODULES = ["paged_attention", "sampling", "draft_step", "kv_write", "rms_norm", "rope", "silu_and_mul",
                  "mask_finished_rows"]
RECORDED_OPS = ["write_kv", "paged_attention", "rms_norm", "silu_and_mul", "apply_rope", "argmax", "gumbel_sample",
                "advance_draft_step", "mask_finished_rows"]


@pytest.mark.parametrize("head", ["eagle3", "eagle1"])
def test_after_the_warm_up_pre_drafting_traffic_compiles_nothing(monkeypatch, tmp_path, head):
    """The CUDA warm-up (runtime.warm_up: the kernel variants, then its steps) leaves nothing to compile for the
    traffic of an engine with pre-drafting at budgets 2-32: hits and misses of random acceptance, pending rows, batches
    of 1 and 4, short and split contexts. On the CPU each op records the compile key its Triton launcher would use
    (the kernels replaced by recorders) and then computes with the CPU implementation. (An H200 run of the demo pair
    stalled ~300 ms in steps that compiled the attention of 5-8 query rows over a split context.)"""
    import pathlib
    import random
    import types

    from conftest import make_config
    from drafter_kernels import ops
    from drafter_service import runtime
    from drafter_service.engine.step_io import StepInput

    recorders = []
    for name in KERNEL_MODULES:
        module = kernel_module(name)
        for attr, value in list(vars(module).items()):
            if type(value).__name__ in ("JITFunction", "InterpretedFunction"):
                rec = CompileKeys(value)
                monkeypatch.setattr(module, attr, rec)
                recorders.append((f"{name}.{attr}", rec))

    for name in RECORDED_OPS:
        op = getattr(ops, name)

        def recording(*args, _op=op, **kwargs):
            _op.triton(*args, **kwargs)  # records the key only (the kernels are recorders: nothing is written)
            return _op(*args, **kwargs)
        monkeypatch.setattr(ops, name, recording)
    # the warm-up runs its CUDA-only part (the kernel variants) as on a GPU
    monkeypatch.setattr(runtime, "ops", types.SimpleNamespace(use_triton=lambda tensor: True))

    models = pathlib.Path(__file__).resolve().parent.parent / "models"
    rt = runtime.build_runtime(make_config(models / head, models / "target", tmp_path, max_model_len=2048))
    runtime.warm_up(rt.proposer, rt.limits.hidden_states_width, rt.limits.max_draft_tokens)
    warm = {name: set(rec.keys) for name, rec in recorders}

    p, width, k = rt.proposer, rt.limits.hidden_states_width, 3
    g, rnd = torch.Generator().manual_seed(0), random.Random(0)
    for F in (4, 2, 16, 32):
        for B in (1, 4):
            for ctx in (30, 300):  # (300: the attention splits the context)
                ns, ids = f"F{F}B{B}c{ctx}", [f"s{i}" for i in range(B)]
                p.step([StepInput(ns, s, 0, torch.randint(0, 100, (ctx,), generator=g),
                                  torch.randn(ctx, width, generator=g), 1, 0) for s in ids])
                last = {s: (ctx, 1, []) for s in ids}  # position and token of the next step's first row, drafts
                for _ in range(8):
                    steps = []
                    for s in ids:
                        seq = p.table.get(ns, s)
                        branches = seq.predraft.branches if seq.predraft is not None else None
                        pos, tok, drafts = last[s]
                        if branches is not None and branches.outcomes and rnd.random() < 0.5:  # a hit
                            a, b = rnd.choice(list(branches.outcomes))
                        else:  # a miss (or plain): random acceptance
                            a, b = rnd.randint(0, len(drafts)), rnd.randint(0, 99)
                        toks = [tok] + list(drafts[:a])
                        steps.append(StepInput(ns, s, pos, torch.tensor(toks), torch.randn(len(toks), width, generator=g),
                                               b, k, predraft_branches=F))
                    out = p.step(steps)
                    assert all(o.code == 0 for o in out), out[0].message
                    for st, o in zip(steps, out):
                        last[st.sequence_id] = (st.start_position + st.token_ids.shape[0], st.next_token, list(o.drafts))
                    if p.predraft.has_work() and rnd.random() < 0.7:  # (sometimes the next step comes first)
                        p.predraft.prepare(lambda: False)
                for s in ids:
                    p.table.release(ns, s)
    new = {name: sorted(set(rec.keys) - warm[name]) for name, rec in recorders}
    assert not any(new.values()), {name: keys for name, keys in new.items() if keys}
