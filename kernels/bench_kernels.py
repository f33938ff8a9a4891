"""Micro-benchmark of the hot Triton kernels on a CUDA device: time, bytes, and the bandwidth floor of each.

    python -m drafter_kernels.bench_kernels                      # table on stdout, JSON next to the cwd
    python -m drafter_kernels.bench_kernels --json out.json --sweep

Cases (bf16, Llama-3.1-8B EAGLE head shapes: 32 query / 8 KV heads, head_dim 128, vocab 128256):
  decode attention   batch 1 / 8 / 32 / 128, one query row per sequence, context --context (1024), block 16
  prefill attention  batch 1 / 32, 3 query rows per sequence (the first draft step), same context
  argmax             [1 | 32, 128256]
  gumbel_sample      [1 | 32, 128256], temperature 1, with and without the chosen token's logprob
Each is timed with triton.testing.do_bench (median; it flushes L2 between runs, so KV and logits come from HBM,
as in a real step where the lm_head's weights evict them). "floor" is the fewest bytes the op must move over the
device-to-device copy bandwidth measured first (bytes read + written); "of floor" = floor / time.
The block tables are as wide as a CUDA-graph step's (--max-model-len, default context + 64, like
scripts/profile_step.py): the split count depends on that width, never on device values.
Each case is also checked against its torch reference (relative error; token ids exactly).
--sweep additionally times decode attention over KV tile / warps / split-count variants (internal knobs).
"""
import argparse
import json
import math
import sys
import time

import torch

from drafter_kernels import paged_attention as pa
from drafter_kernels import sampling
from drafter_kernels._triton_shim import HAS_TRITON, triton

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, VOCAB = 32, 8, 128, 128256


def median_us(fn, rep_ms: int = 200) -> float:
    return 1000.0 * triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")


def copy_bandwidth_gbps(device) -> float:
    """Device-to-device copy of 1 GiB, counting bytes read + written."""
    src = torch.empty(2**30, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    us = median_us(lambda: dst.copy_(src))
    return 2 * src.numel() / (us * 1e-6) / 1e9


def relative_error(actual, expected) -> float:
    actual, expected = actual.float(), expected.float()
    return ((actual - expected).norm() / expected.norm()).item()


def attention_batch(batch, q_len, context, max_model_len, block_size, device, dtype, seed):
    """Scattered paged KV for `batch` sequences of `context` positions, q_len new rows each (the last ones)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_seq = -(-context // block_size)
    width = -(-max_model_len // block_size)
    num_blocks = batch * blocks_per_seq + 1
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    block_tables = torch.zeros(batch, width, dtype=torch.int32)
    block_tables[:, :blocks_per_seq] = torch.randperm(num_blocks - 1, generator=gen)[: batch * blocks_per_seq] \
        .view(batch, blocks_per_seq).int()
    q = torch.randn(batch * q_len, NUM_Q_HEADS, HEAD_DIM, generator=gen).to(device=device, dtype=dtype)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, block_tables.to(device), seq_lens, query_start_loc


def attention_bytes(batch, q_len, context, dtype) -> int:
    elt = torch.finfo(dtype).bits // 8
    kv = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * elt
    q_out = 2 * batch * q_len * NUM_Q_HEADS * HEAD_DIM * elt
    return kv + q_out + batch * (-(-context // 16)) * 4


def bench_attention(args, device, dtype, bw_gbps, rows, sweep_rows):
    for kind, q_len, batches in (("decode attention", 1, (1, 8, 32, 128)), ("prefill attention", 3, (1, 32))):
        for batch in batches:
            q, k, v, bt, sl, qsl = attention_batch(batch, q_len, args.context, args.max_model_len, 16, device, dtype,
                                                   seed=batch)
            scale = HEAD_DIM**-0.5
            out = torch.empty_like(q)
            fn = lambda: pa.paged_attention_triton(q, k, v, bt, sl, qsl, scale, max_query_len=q_len, out=out)  # noqa
            fn()
            expected = pa.paged_attention_ref(q.float(), k.float(), v.float(), bt, sl, qsl, scale)
            err = relative_error(out, expected)
            cfg = pa.attention_launch_config(batch, q_len, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, bt.shape[1] * 16,
                                             pa.device_sm_count(q.device), dtype == torch.float32)
            nbytes = attention_bytes(batch, q_len, args.context, dtype)
            rows.append(row(kind, f"B={batch} q={q_len} ctx={args.context}", median_us(fn), nbytes, bw_gbps,
                            f"rel_err={err:.1e}",
                            f"splits={cfg['num_splits']} M={cfg['block_m']}x{cfg['block_h']} N={cfg['block_n']} "
                            f"w={cfg['num_warps']}"))
            if args.sweep and q_len == 1:
                auto = cfg["num_splits"]
                for block_n in (16, 32, 64, 128):
                    for num_warps in (4, 8):
                        for splits in sorted({1, max(1, auto // 2), auto, 2 * auto}):
                            def variant(block_n=block_n, num_warps=num_warps, splits=splits):
                                pa._paged_attention_launch(q, k, v, bt, sl, qsl, scale, 1, out, num_splits=splits,
                                                           block_n=block_n, num_warps=num_warps)
                            try:
                                variant()
                                err = relative_error(out, expected)
                                us = median_us(variant, rep_ms=50)
                            except Exception as exc:  # e.g. out of shared memory for a large tile
                                print(f"  sweep B={batch} N={block_n} w={num_warps} S={splits}: {exc!r:.80}")
                                continue
                            sweep_rows.append(dict(batch=batch, block_n=block_n, num_warps=num_warps, splits=splits,
                                                   us=us, rel_err=err, auto=(block_n, num_warps, splits) == (
                                                       cfg["block_n"], cfg["num_warps"], auto)))


def bench_sampling(device, dtype, bw_gbps, rows):
    elt = torch.finfo(dtype).bits // 8
    for batch in (1, 32):
        logits = (torch.randn(batch, VOCAB, device=device) * 3).to(dtype)
        out = torch.empty(batch, dtype=torch.int64, device=device)
        nbytes = batch * VOCAB * elt + batch * 8
        sampling.argmax_triton(logits, out=out)
        exact = torch.equal(out, logits.argmax(-1))
        block_v, chunk = sampling.vocab_launch_config(batch, VOCAB, sampling.device_sm_count(logits.device))
        chunking = f"chunks={-(-VOCAB // chunk)} of {chunk} (tile {block_v})"
        rows.append(row("argmax", f"[{batch}, {VOCAB}]", median_us(lambda: sampling.argmax_triton(logits, out=out)),
                        nbytes, bw_gbps, f"exact={exact}", chunking))
        rows.append(row("torch.argmax", f"[{batch}, {VOCAB}]", median_us(lambda: torch.argmax(logits, -1)),
                        nbytes, bw_gbps, "", "baseline"))
        temperature = torch.ones(batch, device=device)
        seed = torch.arange(batch, device=device) + 1
        position = torch.arange(batch, device=device) + 1000
        logprobs = torch.empty(batch, dtype=torch.float32, device=device)
        for with_logprobs in (False, True):
            def fn(with_logprobs=with_logprobs):
                return sampling.gumbel_sample_triton(logits, temperature, seed, position, return_logprobs=with_logprobs,
                                                     out=out, out_logprobs=logprobs if with_logprobs else None)
            fn()
            expected = sampling.gumbel_sample_ref(logits, temperature, seed, position)
            rows.append(row("gumbel_sample" + (" +logprob" if with_logprobs else ""), f"[{batch}, {VOCAB}]",
                            median_us(fn), nbytes, bw_gbps, f"exact={torch.equal(out, expected)}", chunking))


def row(op, shape, us, nbytes, bw_gbps, check, config):
    floor_us = nbytes / (bw_gbps * 1e9) * 1e6
    return dict(op=op, shape=shape, us=round(us, 2), bytes=nbytes, floor_us=round(floor_us, 2),
                gbps=round(nbytes / (us * 1e-6) / 1e9, 1), of_floor=round(floor_us / us, 3), check=check,
                config=config)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--max-model-len", type=int, default=None, help="block-table width in tokens (default ctx+64)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--sweep", action="store_true", help="also time decode-attention tile/warp/split variants")
    ap.add_argument("--json", default=None, help="output path (default bench_kernels_<time>.json)")
    args = ap.parse_args()
    args.max_model_len = args.max_model_len or args.context + 64
    if not (HAS_TRITON and torch.cuda.is_available()):
        print("needs a CUDA device and triton", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    bw = copy_bandwidth_gbps(device)
    rows, sweep_rows = [], []
    with torch.inference_mode():
        bench_attention(args, device, dtype, bw, rows, sweep_rows)
        bench_sampling(device, dtype, bw, rows)

    props = torch.cuda.get_device_properties(device)
    print(f"{props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, triton {triton.__version__}; "
          f"copy bandwidth {bw:.0f} GB/s (read + write); {args.dtype}, block tables {args.max_model_len} tokens wide")
    header = f"{'op':<20} {'shape':<22} {'us':>9} {'floor us':>9} {'GB/s':>8} {'of floor':>8}  {'check':<14} config"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['op']:<20} {r['shape']:<22} {r['us']:>9.2f} {r['floor_us']:>9.2f} {r['gbps']:>8.0f} "
              f"{r['of_floor']:>8.1%}  {r['check']:<14} {r['config']}")
    if sweep_rows:
        print("\ndecode attention sweep (best 5 per batch; * = the launcher's own choice)")
        for batch in sorted({r["batch"] for r in sweep_rows}):
            ranked = sorted((r for r in sweep_rows if r["batch"] == batch), key=lambda r: r["us"])
            auto = [r for r in ranked if r["auto"]]
            for r in ranked[:5] + [a for a in auto if a not in ranked[:5]]:
                print(f"  B={batch:<4} N={r['block_n']:<4} warps={r['num_warps']} splits={r['splits']:<4} "
                      f"{r['us']:8.2f} us  rel_err={r['rel_err']:.1e}{'  *' if r['auto'] else ''}")
    path = args.json or f"bench_kernels_{time.strftime('%Y%m%d-%H%M%S')}.json"
    with open(path, "w") as f:
        json.dump(dict(device=props.name, sm_count=props.multi_processor_count, torch=torch.__version__,
                       triton=triton.__version__, dtype=args.dtype, context=args.context,
                       max_model_len=args.max_model_len, copy_gbps=round(bw, 1), rows=rows, sweep=sweep_rows),
                  f, indent=1)
    print(f"wrote {path}")
    bad = [r for r in rows if "exact=False" in r["check"]
           or ("rel_err" in r["check"] and not float(r["check"].split("=")[1]) < 2e-2)
           or math.isnan(r["us"])]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
