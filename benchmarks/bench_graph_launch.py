"""The host cost of one CUDA graph launch: torch's CUDAGraph.replay() against cudaGraphLaunch called by ctypes on
the same graph's exec handle (CUDA only).

    python benchmarks/bench_graph_launch.py --out F.json

A greedy engine step replays a first-step graph and k - 1 decode-step graphs (drafter_service/engine/cuda_graphs.py);
whether torch's replay() adds host time worth bypassing (a generator prologue, the Python binding) is what this
measures: graphs of 1-48 small kernels, each launch timed while the GPU is kept busy (torch.cuda._sleep ahead of
them, so that no launch waits for the device), median and p10/p90 of 200 launches. Also: what replay() issues
besides the graph (the profiler's host events over three replays), and current_stream()'s own cost, which the
step's synchronization looks up. Prints a line per graph size and writes JSON (device, date, command, rows).
"""
import argparse
import ctypes
import datetime
import pathlib
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from drafter_client.benchmarks.report import write_json  # noqa: E402

SIZES = (1, 12, 24, 48)


def load_cudart() -> ctypes.CDLL:
    """The CUDA runtime torch itself loaded (its soname resolves to the loaded copy)."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError("no libcudart found by soname")


def timed_us(fn, n: int = 200) -> dict:
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e8))  # the GPU busy: no launch below waits for it
    times = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    torch.cuda.synchronize()
    times.sort()
    return dict(median=statistics.median(times) / 1e3, p10=times[n // 10] / 1e3, p90=times[9 * n // 10] / 1e3)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_graph_launch.py needs CUDA; none here")
        return 2
    x = torch.randn(64, 256, device="cuda")
    out = torch.empty_like(x)

    def body(n: int) -> None:  # n elementwise kernels, then one copy into out
        y = x
        for _ in range(n):
            y = y * 1.0001 + 0.1
        out.copy_(y)

    stream = torch.cuda.Stream()
    graphs = {}
    for n in SIZES:
        with torch.cuda.stream(stream):
            body(n)  # (warm-up off the capture)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            body(n)
        graphs[n] = graph
    cudart = load_cudart()
    launch = cudart.cudaGraphLaunch
    launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    launch.restype = ctypes.c_int
    current = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    result = dict(benchmark="graph_launch", date=datetime.datetime.now().isoformat(timespec="seconds"),
                  host=platform.node(), device=f"cuda: {torch.cuda.get_device_name()}", torch=torch.__version__,
                  command=" ".join(["benchmarks/bench_graph_launch.py", *sys.argv[1:]]), rows=[])
    for n, graph in graphs.items():
        handle = ctypes.c_void_p(graph.raw_cuda_graph_exec())
        replay = timed_us(graph.replay)
        raw = timed_us(lambda: launch(handle, current))
        lookup = timed_us(lambda: torch.cuda.current_stream())
        result["rows"].append(dict(kernels=n + 1, replay_us=replay, cuda_graph_launch_us=raw,
                                   current_stream_us=lookup))
        print(f"graph of {n + 1:2d} kernels: replay() {replay['median']:.1f} us [p10 {replay['p10']:.1f}, p90 "
              f"{replay['p90']:.1f}]; cudaGraphLaunch by ctypes {raw['median']:.1f} us [{raw['p10']:.1f}, "
              f"{raw['p90']:.1f}]; torch.cuda.current_stream() {lookup['median']:.1f} us", flush=True)
    graph = graphs[SIZES[-1]]
    graph.replay()
    torch.cuda.synchronize()
    first = out.clone()
    if launch(ctypes.c_void_p(graph.raw_cuda_graph_exec()), current) != 0:
        raise RuntimeError("cudaGraphLaunch failed")
    torch.cuda.synchronize()
    result["same_output_both_ways"] = bool(torch.equal(first, out))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            graph.replay()
        torch.cuda.synchronize()
    issued: dict[str, int] = {}
    for e in prof.events():
        if e.name.startswith("cuda") or e.name.startswith("aten::"):
            issued[e.name] = issued.get(e.name, 0) + 1
    result["host_calls_in_three_replays"] = issued
    print(f"same output both ways: {result['same_output_both_ways']}; host calls in three replay() calls: {issued}")
    if a.out:
        write_json(a.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
