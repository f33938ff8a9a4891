"""--cpu-threads: the drafter's share of the CPU cores for its draft step."""
import pytest
import torch

from drafter_service.cli import parse_args
from drafter_service.config import ServerConfig
from drafter_service.runtime import build_runtime


def test_flag_fills_the_config_and_defaults_to_torch():
    assert parse_args(["--cpu-threads", "1"]).cpu_threads == 1
    assert parse_args([]).cpu_threads == 0


def test_negative_thread_count_is_refused():
    with pytest.raises(ValueError, match="cpu_threads"):
        ServerConfig(model="m", cpu_threads=-1)


def test_runtime_on_cpu_takes_its_thread_count():
    before = torch.get_num_threads()
    want = 1 if before != 1 else 2
    try:
        cfg = parse_args(["--device", "cpu", "--cpu-threads", str(want), "--kv-cache-tokens", "4096"])
        build_runtime(cfg)
        assert torch.get_num_threads() == want
    finally:
        torch.set_num_threads(before)


def test_runtime_on_cpu_without_the_flag_keeps_torch_default():
    before = torch.get_num_threads()
    build_runtime(parse_args(["--device", "cpu", "--kv-cache-tokens", "4096"]))
    assert torch.get_num_threads() == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_runtime_on_cuda_runs_its_host_side_on_one_thread():
    """On CUDA the host side of a step is small tensors: one torch thread unless --cpu-threads says otherwise (a
    pool of one thread per core cost 1-2 ms per CPU op that woke it on an H100 VM; docs/performance.md)."""
    before = torch.get_num_threads()
    try:
        build_runtime(parse_args(["--device", "cuda", "--kv-cache-tokens", "4096", "--no-cuda-graphs"]))
        assert torch.get_num_threads() == 1
        build_runtime(parse_args(["--device", "cuda", "--kv-cache-tokens", "4096", "--no-cuda-graphs",
                                  "--cpu-threads", "3"]))
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
