"""ops: dispatch rules (Triton on CUDA when available, DRAFTER_KERNELS=torch forces references), signatures,
and that drafter_kernels imports and runs on CPU without triton installed."""
import inspect
import os
import subprocess
import sys
import types

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: @triton.jit reads it when kernels are defined

from drafter_kernels import ops  # noqa: E402

OP_NAMES = ["write_kv", "paged_attention", "rms_norm", "apply_rope", "argmax", "gumbel_sample",
            "copy_and_expand_inputs", "prepare_inputs_padded", "prepare_next_token_padded", "advance_draft_step",
            "shift_and_cache"]


@pytest.mark.parametrize("name", OP_NAMES)
def test_op_reference_and_launcher_share_one_signature(name):
    op = getattr(ops, name)
    assert inspect.signature(op) == inspect.signature(op.reference) == inspect.signature(op.triton)
    assert op.reference.__name__ == f"{name}_ref" and op.triton.__name__ == f"{name}_triton"


def test_existing_exports_kept():
    for name in ["write_kv", "paged_attention", "rms_norm", "apply_rope", "argmax"]:
        assert name in ops.__all__ and callable(getattr(ops, name))


def test_use_triton_rules(monkeypatch):
    cuda_tensor, cpu_tensor = types.SimpleNamespace(is_cuda=True), torch.zeros(1)
    monkeypatch.delenv("DRAFTER_KERNELS", raising=False)
    monkeypatch.setattr(ops, "HAS_TRITON", True)
    assert ops.use_triton(cuda_tensor) and not ops.use_triton(cpu_tensor)
    monkeypatch.setenv("DRAFTER_KERNELS", "torch")
    assert not ops.use_triton(cuda_tensor)
    monkeypatch.setenv("DRAFTER_KERNELS", "auto")
    assert ops.use_triton(cuda_tensor)
    monkeypatch.setattr(ops, "HAS_TRITON", False)
    assert not ops.use_triton(cuda_tensor)


def test_dispatch_routes_by_first_tensor(monkeypatch):
    calls = []

    def fake_ref(x, scale, *, flag=False):
        calls.append(("ref", scale, flag))

    def fake_triton(x, scale, *, flag=False):
        calls.append(("triton", scale, flag))

    op = ops._dispatch(fake_ref, fake_triton)
    monkeypatch.setattr(ops, "use_triton", lambda tensor: tensor.dtype == torch.float16)
    op(torch.zeros(1), 2.0)
    op(torch.zeros(1, dtype=torch.float16), 3.0, flag=True)
    op(x=torch.zeros(1, dtype=torch.float16), scale=4.0)  # tensors passed by keyword count too
    assert calls == [("ref", 2.0, False), ("triton", 3.0, True), ("triton", 4.0, False)]


def test_cpu_tensors_use_references():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0]])
    assert ops.argmax(logits).tolist() == [1]
    x, weight = torch.randn(2, 8), torch.ones(8)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6)[0], ops.rms_norm.reference(x, weight, 1e-6)[0])


def test_imports_and_runs_without_triton():
    script = (
        "import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"  # makes `import triton` fail
        "import torch\n"
        "from drafter_kernels import ops\n"
        "from drafter_kernels._triton_shim import HAS_TRITON\n"
        "assert not HAS_TRITON\n"
        "assert ops.argmax(torch.tensor([[1.0, 3.0, 2.0]])).tolist() == [1]\n"
        "try:\n"
        "    ops.argmax.triton(torch.zeros(1, 3))\n"
        "except RuntimeError as error:\n"
        "    assert 'triton is not installed' in str(error)\n"
        "else:\n"
        "    raise AssertionError('launching without triton must fail')\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
