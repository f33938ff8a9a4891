"""The GEMMs of an 8B EAGLE-3 head against their weight-read floor, per row count M (a script, not a test; CUDA).

    python scripts/gemm_shapes.py --out gpu_out/gemm_shapes.json

Prints a table (us per GEMM, timed as CUDA-graph replays; floor = the weight's bytes over the measured copy
bandwidth) and writes it as JSON with the device and the date. F.linear(x, W [N, K]) is how the head runs them;
torch.mm(x, Wt) has the weight stored transposed [K, N] (whether cuBLAS does better with that layout; "same": the two
give the same bits). M = 1 and 8 (decode steps at small batch), 128 (decode at batch 128), 384 (a first step of three
tokens per sequence at batch 128).
"""
import argparse
import datetime
import json
import pathlib

import torch
import torch.nn.functional as F

SHAPES = {"qkv (2H in)": (6144, 8192), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head 32k": (32000, 4096), "fc 3H": (4096, 12288)}  # (N, K) of an 8B EAGLE-3 head, bf16
ROWS = (1, 8, 128, 384)


def copy_bandwidth(dev: torch.device) -> float:
    """Bytes per second of a 1 GiB device copy (read + write)."""
    a = torch.empty(2**29, dtype=torch.bfloat16, device=dev)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    st, en = torch.cuda.Event(True), torch.cuda.Event(True)
    st.record()
    for _ in range(10):
        b.copy_(a)
    en.record()
    en.synchronize()
    return 2 * a.numel() * 2 * 10 / (st.elapsed_time(en) / 1e3)


def graph_time_us(f, reps: int = 200) -> float:
    """Microseconds per call of f, 20 calls per captured graph, replayed reps / 20 times."""
    for _ in range(10):
        f()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            f()
    g.replay()
    torch.cuda.synchronize()
    st, en = torch.cuda.Event(True), torch.cuda.Event(True)
    st.record()
    for _ in range(reps // 20):
        g.replay()
    en.record()
    en.synchronize()
    return st.elapsed_time(en) * 1e3 / reps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out/gemm_shapes.json")
    a = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    bw = copy_bandwidth(dev)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                  date=datetime.datetime.now().isoformat(timespec="seconds"), copy_tb_s=bw / 1e12, rows=[])
    print(f"{result['device']}, {result['date']}: copy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"{'shape':14s} {'M':>4s} {'floor us':>9s} {'linear':>8s} {'mm(Wt)':>8s} {'linear/floor':>12s} {'mm/floor':>9s}")
    for name, (N, K) in SHAPES.items():
        W = torch.randn(N, K, device=dev, dtype=dt) * 0.02
        Wt = W.t().contiguous()
        for M in ROWS:
            x = torch.randn(M, K, device=dev, dtype=dt)
            floor = N * K * 2 / bw * 1e6
            t1, t2 = graph_time_us(lambda: F.linear(x, W)), graph_time_us(lambda: torch.mm(x, Wt))
            same = torch.equal(F.linear(x, W), torch.mm(x, Wt))
            result["rows"].append(dict(shape=name, n=N, k=K, m=M, floor_us=floor, linear_us=t1, mm_transposed_us=t2,
                                       same_bits=same))
            print(f"{name:14s} {M:4d} {floor:9.1f} {t1:8.1f} {t2:8.1f} {t1 / floor:12.2f} {t2 / floor:9.2f}  "
                  f"{'same' if same else 'differs'}")
    out = pathlib.Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
