"""The GEMMs of an 8B EAGLE-3 head against their weight-read floor, per row count M (a script, not a test; CUDA).

    python scripts/gemm_shapes.py        # prints a table: us per GEMM (CUDA-graph replays), floor = weight bytes / bandwidth

F.linear(x, W [N, K]) as the head runs them, and torch.mm(x, Wt) with the weight stored transposed [K, N] (whether
cuBLAS does better with the other layout; "same": the two give the same bits). M = 1 and 8 (decode steps at small
batch), 128 (decode at batch 128), 384 (a first step of 3 tokens per sequence at batch 128).
"""
import torch, torch.nn.functional as F
dev = torch.device("cuda"); dt = torch.bfloat16
shapes = {"qkv (2H in)": (6144, 8192), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head 32k": (32000, 4096), "fc 3H": (4096, 12288)}
# bandwidth: a big copy
a = torch.empty(2**30 // 2, dtype=dt, device=dev); b = torch.empty_like(a)
for _ in range(3): b.copy_(a)
st, en = torch.cuda.Event(True), torch.cuda.Event(True); st.record()
for _ in range(10): b.copy_(a)
en.record(); en.synchronize(); bw = 2 * a.numel() * 2 * 10 / (st.elapsed_time(en) / 1e3); del a, b
print(f"copy bandwidth {bw/1e12:.2f} TB/s")
def timeit(f, reps=200):
    for _ in range(10): f()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20): f()
    g.replay(); torch.cuda.synchronize()
    st.record()
    for _ in range(reps // 20): g.replay()
    en.record(); en.synchronize()
    return st.elapsed_time(en) * 1e3 / reps
print(f"{'shape':14s} {'M':>4s} {'floor us':>9s} {'linear':>8s} {'mm(Wt)':>8s} {'linear/floor':>12s} {'mm/floor':>9s}")
for name, (N, K) in shapes.items():
    W = torch.randn(N, K, device=dev, dtype=dt) * 0.02
    Wt = W.t().contiguous()
    for M in (1, 8, 128, 384):
        x = torch.randn(M, K, device=dev, dtype=dt)
        floor = N * K * 2 / bw * 1e6
        t1 = timeit(lambda: F.linear(x, W)); t2 = timeit(lambda: torch.mm(x, Wt))
        same = torch.equal(F.linear(x, W), torch.mm(x, Wt))
        print(f"{name:14s} {M:4d} {floor:9.1f} {t1:8.1f} {t2:8.1f} {t1/floor:12.2f} {t2/floor:9.2f}  {'same' if same else 'differs'}")
