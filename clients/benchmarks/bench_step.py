"""Benchmark: one engine step through the sidecar (client over UDS, server in its own process) against the same
proposer called in-process, with the floor (bytes a step must read over measured memory bandwidth).

    python -m drafter_client.benchmarks.bench_step --preset small --device cpu          # minutes on a laptop CPU
    python -m drafter_client.benchmarks.bench_step --preset llama3-8b --device cuda     # the GPU table
    python -m drafter_client.benchmarks.bench_step --preset llama3-8b-eagle3 --device cuda   # EAGLE-3 head
    ... --device cuda --graphs-ab      # also the in-process proposer with --no-cuda-graphs, in the same run
    ... --rounds 5                     # then the channel / in-process ratio over 5 alternating rounds
    ... --rounds 2 --rounds-only       # the in-process step, its floor and the rounds only
    ... --rounds 3 --engine-gap-ms 20  # the rounds' steps each after 20 ms of the engine's own work (a spin)

The head has random weights of the preset's shape (written once to a temp dir as a Hugging Face checkpoint, which
the server process loads). Each timed step is a decode step: every sequence sends m committed tokens at a context
of --context tokens and asks for k drafts (the same positions are re-sent every iteration, which the protocol
allows, so the context stays fixed). The in-process step gets the hidden states as host tensors, as the sidecar
does (staged through pinned memory to the GPU); on a GPU it also runs with the states already there (column "in, GPU
states": an engine in the drafter's process, or the sidecar's CUDA IPC plane). The sidecar paths: unary Propose with
one SequenceStep per sequence (column "sidecar ms"), the batch API (propose_batch: columns in and out) by unary gRPC
("ubatch ms": what an engine on another node pays), one ProposeStream, a step channel with each API, and (CUDA) the
channel with the states by CUDA IPC reference. Prints a table and writes JSON (device, date, command) to --out,
after each batch size's sidecar runs and rounds too ("complete": false until the end), so that a run stopped by a
time limit keeps what it measured.
"""
import argparse
import asyncio
import dataclasses
import datetime
import json
import os
import pathlib
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from safetensors.torch import save_file

from drafter_client.benchmarks.report import write_json
from drafter_client.engine.sidecar_process import free_port, wait_serving

PRESETS = {
    # name: head shape (Llama), target vocab, dtype, default context
    "tiny": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=512, context=256),
    "tiny-eagle3": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                        vocab_size=512, draft_vocab_size=256, method="eagle3", context=256),
    "small": dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=4,
                  vocab_size=32000, context=512),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      vocab_size=128256, context=1024),
    # EAGLE-3 head of Llama-3.1-8B (as yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): the target sends 3 x 4096 columns per
    # token (its states entering layers 2, 16, 29), the head drafts over a 32000-token draft vocabulary (d2t).
    "llama3-8b-eagle3": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                             vocab_size=128256, draft_vocab_size=32000, method="eagle3", context=1024),
}
CONFIG_SKIP = ("context", "method")  # preset keys that are not config.json fields


def write_random_head(root: pathlib.Path, shape: dict, max_len: int, seed: int = 0) -> tuple[pathlib.Path, pathlib.Path]:
    g = torch.Generator().manual_seed(seed)
    H, I, V = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    hd = H // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd

    def w(*s):
        return (torch.randn(*s, generator=g) * s[-1] ** -0.5).to(torch.bfloat16)

    eagle3 = shape.get("method") == "eagle3"
    cfg = dict(architectures=["LlamaForCausalLMEagle3" if eagle3 else "LlamaForCausalLM"], model_type="llama",
               num_hidden_layers=1, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=max_len,
               tie_word_embeddings=False, **{k: v for k, v in shape.items() if k not in CONFIG_SKIP})
    head, target = root / "head", root / "target"
    head.mkdir(parents=True)
    target.mkdir(parents=True)

    def ones():  # (a fresh tensor each: safetensors refuses tensors that share memory)
        return torch.ones(H, dtype=torch.bfloat16)

    layer = {"self_attn.o_proj.weight": w(H, q), "post_attention_layernorm.weight": ones(),
             "mlp.gate_proj.weight": w(I, H), "mlp.up_proj.weight": w(I, H), "mlp.down_proj.weight": w(H, I)}
    if eagle3:
        cfg["eagle_config"] = dict(eagle_aux_hidden_state_layer_ids=[2, 16, 29], use_aux_hidden_state=True)
        Vd = shape["draft_vocab_size"]
        # draft id i -> target id i + d2t[i]: Vd distinct target ids spread over the target vocabulary
        d2t = torch.randperm(V, generator=g)[:Vd].sort().values - torch.arange(Vd)
        layer.update({"self_attn.q_proj.weight": w(q, 2 * H), "self_attn.k_proj.weight": w(kv, 2 * H),
                      "self_attn.v_proj.weight": w(kv, 2 * H), "input_layernorm.weight": ones(),
                      "hidden_norm.weight": ones()})
        weights = {"fc.weight": w(H, 3 * H), "norm.weight": ones(), "lm_head.weight": w(Vd, H), "d2t": d2t,
                   **{f"midlayer.{k}": v for k, v in layer.items()}}
    else:
        layer.update({"self_attn.q_proj.weight": w(q, H), "self_attn.k_proj.weight": w(kv, H),
                      "self_attn.v_proj.weight": w(kv, H)})
        weights = {"fc.weight": w(H, 2 * H), **{f"layers.0.{k}": v for k, v in layer.items()}}
    (head / "config.json").write_text(json.dumps(cfg))
    save_file(weights, str(head / "model.safetensors"))
    (target / "config.json").write_text(json.dumps(dict(cfg, num_hidden_layers=32)))
    save_file({"model.embed_tokens.weight": w(V, H), "lm_head.weight": w(V, H)}, str(target / "model.safetensors"))
    return head, target


def random_head_config(root: pathlib.Path, shape: dict, max_len: int, *, device: str, kv_cache_tokens: int,
                       max_batch_seqs: int = 512, dtype: str | None = None, **config):
    """A drafter ServerConfig for a random head of this shape, written under root (its model and target_model are
    the head's and the target's directories): max_model_len max_len, dtype bf16 on CUDA and fp32 on the CPU unless
    given; config: other ServerConfig fields (cuda_graphs, engine_applies_fc, ...)."""
    from drafter_service.config import ServerConfig

    head, target = write_random_head(root, shape, max_len)
    dtype = dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    return ServerConfig(model=str(head), target_model=str(target), device=device, dtype=dtype,
                        kv_cache_tokens=kv_cache_tokens, max_model_len=max_len, max_batch_seqs=max_batch_seqs, **config)


def random_head_runtime(root: pathlib.Path, shape: dict, max_len: int, **kwargs):
    """The drafter's runtime (drafter_service.runtime.build_runtime: proposer, KV pool, graphs) on random_head_config's
    head, for timing the proposer in-process (the benchmark scripts)."""
    from drafter_service.runtime import build_runtime

    return build_runtime(random_head_config(root, shape, max_len, **kwargs))


def measure_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large copy, counting bytes read plus bytes written."""
    n = (1 << 30) if device.type == "cuda" else (1 << 28)
    a = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.copy_(a)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 2 * n / statistics.median(times[2:])


def floor_bytes(shape: dict, dtype_bytes: int, batch: int, context: int, m: int, k: int,
                engine_applies_fc: bool = False) -> int:
    """Bytes one engine step must read at least: per forward (1 + (k-1) decode), the head's weights once, the
    lm_head once, and the KV it attends over; plus the hidden states in. EAGLE-1: fc [H, 2H] in every forward,
    q/k/v over H. EAGLE-3: fc [H, 3H] only in the first forward (decode steps reuse the head's own state), q/k/v
    over 2H, lm_head over the draft vocabulary, 3H columns of hidden states per token; engine_applies_fc: no fc
    and H columns (the engine's GEMM is timed apart, engine_fc_ms)."""
    H, I, V = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    hd = H // shape["num_attention_heads"]
    q, kvd = shape["num_attention_heads"] * hd, shape["num_key_value_heads"] * hd
    kv_per_token = 2 * kvd
    kv_read = sum(batch * (context + j) * kv_per_token * dtype_bytes for j in range(k))
    if shape.get("method") == "eagle3":
        layer = q * 2 * H + 2 * kvd * 2 * H + H * q + 3 * H * I
        per_forward = (layer + shape["draft_vocab_size"] * H) * dtype_bytes
        if engine_applies_fc:
            return k * per_forward + kv_read + batch * m * H * dtype_bytes
        return k * per_forward + H * 3 * H * dtype_bytes + kv_read + batch * m * 3 * H * dtype_bytes
    layer = H * 2 * H + q * H + 2 * kvd * H + H * q + 3 * H * I
    per_forward = (layer + V * H) * dtype_bytes
    return k * per_forward + kv_read + batch * m * H * dtype_bytes


def time_engine_fc(head: pathlib.Path, rows: int, device: torch.device, dtype: str, iters: int) -> float:
    """Median seconds of the engine's side of --engine-applies-fc: EngineFc over [rows, 3H] states on the device
    (a synchronize after each)."""
    from drafter_client.engine_fc import EngineFc

    fc = EngineFc.from_head(head, device=device, dtype=dtype)
    states = torch.randn(rows, fc.in_features, device=device).to(fc.weight.dtype)
    times = []
    for _ in range(iters + 3):
        t0 = time.perf_counter()
        fc(states)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:])


def make_steps(batch: int, context: int, m: int, k: int, width: int, vocab: int, seed: int):
    from drafter_client import SequenceStep

    g = torch.Generator().manual_seed(seed)
    prefill, decode = [], []
    for b in range(batch):
        toks = torch.randint(0, vocab, (context + 1,), generator=g)
        hid = torch.randn(context, width, generator=g).to(torch.bfloat16)
        sid = f"b{b}"
        prefill.append(SequenceStep(sid, 0, toks[:context], hid, int(toks[context]), 0))
        p = context - m
        decode.append(SequenceStep(sid, p, toks[p:context], hid[p:context], int(toks[context]), k))
    return prefill, decode


def run_prefill(rt, prefill) -> None:
    """make_steps' prefill steps through the runtime's proposer, eight sequences a step; each must be accepted (a
    refused one would leave the timed decode steps to measure an error path)."""
    for chunk in range(0, len(prefill), 8):
        out = rt.proposer.step(to_inputs(prefill[chunk : chunk + 8]))
        assert all(o.code == 0 for o in out), out[0].message


def prefilled_decode(rt, batch: int, context: int, m: int, k: int, vocab: int, mixed_m: bool = False,
                     states_device: torch.device | str | None = None) -> list:
    """make_steps' sequences b0..b{batch-1} prefilled through rt (context - m tokens each), and their decode step (one
    SequenceStep each, k drafts): m committed tokens each, or 1 + i % m for sequence i with mixed_m (as after varying
    acceptance); the hidden states moved to states_device when given (an engine in the drafter's process holds its
    target's states on the GPU), else on the host."""
    prefill, decode = make_steps(batch, context, m, k, rt.limits.hidden_states_width, vocab, seed=batch)
    run_prefill(rt, prefill)
    if mixed_m:
        decode = [last_tokens(s, 1 + i % m) for i, s in enumerate(decode)]
    if states_device is not None:
        decode = [dataclasses.replace(s, hidden_states=s.hidden_states.to(states_device)) for s in decode]
    return decode


def last_tokens(step, m: int):
    """A decode step of make_steps re-sending only its last m committed tokens (their positions are in the KV
    already): a step of m tokens, as after fewer accepted drafts (mixed m in one batch)."""
    cut = len(step.token_ids) - m
    return dataclasses.replace(step, start_position=step.start_position + cut, token_ids=step.token_ids[cut:],
                               hidden_states=step.hidden_states[cut:])


class AdvancingStep:
    """A columns step (fn: Proposer.step_batch, given one BatchInput) as an engine's decode loop runs it: after each
    step every sequence's next step starts where this one ended (the m tokens it committed later), so that the
    contexts grow and each sequence takes a new KV block every block_size / m steps, as in serving; the fixed-context
    steps of the other benchmarks re-send the same positions and never take one. The move is an in-place add on the
    BatchInput's numpy column (about a microsecond, timed with the step). stagger: sequence i starts i % stagger
    positions earlier (a rollback of its last tokens), so that sequences of one context do not all take their new
    block on the same step (give the block size). After `window` positions, and at rewind(), the positions go back to
    the first step's (a rollback, which the protocol allows: the step after it gives the blocks past them back), after
    checking that the last step committed what it was given (no sequence refused: the steps timed were the steps
    meant). scripts/profile_step.py --advance, benchmarks/bench_block_growth.py."""

    def __init__(self, fn, inputs, window: int = 1024, stagger: int = 1):
        self.fn, self.positions, self.window = fn, inputs.arrays.start_positions, window
        self.positions -= np.arange(self.positions.shape[0]) % stagger
        self.first, self.m = self.positions.copy(), inputs.arrays.num_tokens.copy()
        self.last = None
        self.steps = 0

    def __call__(self, inputs):
        out = self.last = self.fn(inputs)
        self.positions += self.m
        self.steps += 1
        if self.positions[0] > self.first[0] + self.window:
            self.rewind()
        return out

    def rewind(self) -> None:
        if self.last is not None:
            assert int(self.last.codes.abs().sum()) == 0, self.last.messages[:3]
            assert (self.last.committed_lengths.numpy() == self.positions).all(), "a step did not commit its tokens"
        self.positions[:] = self.first


def as_step_batch(steps):
    """The steps as one StepBatch with their states in one tensor (an engine that keeps its batch as tensors:
    propose_batch)."""
    from drafter_client.batch import steps_as_batch

    return dataclasses.replace(steps_as_batch(steps), hidden_states=torch.cat([s.hidden_states for s in steps]))


def to_inputs(steps):
    from drafter_service.engine.step_io import StepInput

    return [StepInput("bench", s.sequence_id, s.start_position, torch.as_tensor(s.token_ids, dtype=torch.int64),
                      s.hidden_states, int(s.next_token), s.num_drafts) for s in steps]


def to_batch_input(steps):
    """The steps as one BatchInput (columns: what an engine in the drafter's process hands Proposer.step_batch)."""
    from drafter_service.engine.batch_io import BatchInput

    return BatchInput.from_lists(
        "bench", [s.sequence_id for s in steps], [s.start_position for s in steps],
        [len(s.token_ids) for s in steps], torch.cat([torch.as_tensor(s.token_ids, dtype=torch.int64) for s in steps]),
        torch.cat([s.hidden_states for s in steps]), [int(s.next_token) for s in steps],
        [s.num_drafts for s in steps], [0.0] * len(steps), [0] * len(steps), [False] * len(steps), [0] * len(steps),
        [0] * len(steps))


def bench_in_process(rt, batch, context, m, k, iters, vocab, states_device: torch.device | None = None,
                     columns: bool = False):
    """Median seconds of the proposer's step called in-process. states_device: the decode steps' hidden states live
    there (a GPU: as an engine in the drafter's process holds its target's states; none to stage through the host),
    else on the host. columns: the step as columns through Proposer.step_batch (one BatchInput), else one StepInput
    per sequence through Proposer.step."""
    decode = prefilled_decode(rt, batch, context, m, k, vocab, states_device=states_device)
    inputs, step = (to_batch_input(decode), rt.proposer.step_batch) if columns else (to_inputs(decode), rt.proposer.step)
    times = []
    for i in range(iters + 3):
        t0 = time.perf_counter()
        out = step(inputs)
        times.append(time.perf_counter() - t0)
    if columns:
        out = out.to_outputs()
    assert all(o.code == 0 and len(o.drafts) == k for o in out), out[0].message
    for s in decode:
        rt.proposer.table.release("bench", s.sequence_id)
    return statistics.median(times[3:])


def metric_values(metrics_port: int) -> dict[str, float]:
    """Every sample of the drafter's /metrics (on 127.0.0.1), by its name with its labels, as written there."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return {name: float(value) for name, value in (line.rsplit(" ", 1) for line in text.splitlines()
                                                   if line and not line.startswith("#"))}


def scrape_server_seconds(metrics_port: int) -> dict[str, float]:
    """Cumulative server-side seconds from the drafter's /metrics: the step worker, and the Propose handler by phase."""
    v = metric_values(metrics_port)
    return {"worker": float(v["drafter_step_seconds_sum"]), "batches": float(v["drafter_step_seconds_count"]),
            "parse": float(v['drafter_rpc_propose_phase_seconds_total{phase="parse"}']),
            "wait": float(v['drafter_rpc_propose_phase_seconds_total{phase="wait"}']),
            "reply": float(v['drafter_rpc_propose_phase_seconds_total{phase="reply"}'])}


async def bench_sidecar(target, batch, context, m, k, iters, width, vocab, metrics_port: int | None = None,
                        device: torch.device | None = None):
    """Median seconds per step seen by the client with unary Propose calls, (when metrics_port) the median of each
    server-side part of those, the median per step on one ProposeStream (client.stream()), the median per step
    through a shared-memory step channel (client.open_step_channel(); None where it cannot be opened), and (device
    a GPU) the median per step through the channel with the hidden states on that GPU, passed by CUDA IPC
    reference (enable_shared_memory(kind="cuda"): the engine's copy into a slot, then a descriptor), the median per
    step through the channel with the batch API (propose_batch(StepBatch): columns in, columns out), and the median
    per step of the batch API by unary gRPC (no channel: an engine on another node)."""
    from drafter_client import DrafterClient
    from drafter_client.messages import build_request

    prefill, decode = make_steps(batch, context, m, k, width, vocab, seed=batch)
    async with DrafterClient(target, namespace="bench", step_timeout_s=None) as c:
        await c.wait_ready(600)
        for chunk in range(0, batch, 8):
            r = await c.propose(prefill[chunk : chunk + 8])
            assert all(s.ok for s in r.sequences), r.sequences[0].message
        times, parts = [], []
        for i in range(iters + 3):
            before = scrape_server_seconds(metrics_port) if metrics_port else None
            t0 = time.perf_counter()
            r = await c.propose(decode)
            times.append(time.perf_counter() - t0)
            if metrics_port:
                after = scrape_server_seconds(metrics_port)
                assert after["batches"] == before["batches"] + 1, "one request should be one batch"
                parts.append({key: after[key] - before[key] for key in after})
        assert all(s.ok and s.drafts.numel() == k for s in r.sequences)
        # the same step as an engine that keeps its batch as tensors sends it (columns from 32 sequences)
        as_batch = as_step_batch(decode)
        unary_batch_times = []
        for i in range(iters + 3):
            t0 = time.perf_counter()
            r = await c.propose_batch(as_batch)
            unary_batch_times.append(time.perf_counter() - t0)
            assert not r.fallback and int(r.codes.abs().sum()) == 0 and bool((r.num_drafts == k).all())
        stream_times = []
        async with c.stream() as session:
            for i in range(iters + 3):
                t0 = time.perf_counter()
                await session.send(decode)
                r = await session.recv()
                stream_times.append(time.perf_counter() - t0)
                assert all(s.ok and s.drafts.numel() == k for s in r.sequences)
        channel_times, channel_parts, channel_ipc_times, channel_batch_times = [], None, [], []
        # the request area must hold a whole step (EAGLE-3 at batch 256: 3 x 4096 bf16 columns x 768 rows > 16 MiB)
        request_bytes = max(16 * 2**20, 2 * build_request("bench", decode, None).ByteSize())
        if await c.open_step_channel(request_bytes=request_bytes):
            for i in range(iters + 3):
                if i == 3 and metrics_port:  # after the warm-up; not between steps (a scrape costs the server time)
                    before = scrape_server_seconds(metrics_port)
                t0 = time.perf_counter()
                r = await c.propose(decode)
                channel_times.append(time.perf_counter() - t0)
                assert all(s.ok and s.drafts.numel() == k for s in r.sequences)
            if metrics_port:  # server-side means over the timed channel steps
                after = scrape_server_seconds(metrics_port)
                channel_parts = {key: (after[key] - before[key]) / iters for key in after}
            assert c.steps_through_channel == iters + 3, "every step should have gone through the channel"
            for i in range(iters + 3):
                t0 = time.perf_counter()
                r = await c.propose_batch(as_batch)
                channel_batch_times.append(time.perf_counter() - t0)
                assert not r.fallback and int(r.codes.abs().sum()) == 0 and bool((r.num_drafts == k).all())
            assert c.steps_through_channel == 2 * (iters + 3), "every step should have gone through the channel"
            if device is not None and device.type == "cuda":
                on_gpu = [dataclasses.replace(s, hidden_states=s.hidden_states.to(device)) for s in decode]
                plane = await c.enable_shared_memory(batch * m, dtype=torch.bfloat16, kind="cuda", device=device)
                assert plane == "cuda", plane
                for i in range(iters + 3):
                    t0 = time.perf_counter()
                    r = await c.propose(on_gpu)
                    channel_ipc_times.append(time.perf_counter() - t0)
                    assert all(s.ok and s.drafts.numel() == k for s in r.sequences)
                assert c.steps_by_reference == iters + 3
                await c.disable_shared_memory()
            c.close_step_channel()
        await c.release([s.sequence_id for s in decode])
    med = {key: statistics.median(p[key] for p in parts[3:]) for key in parts[0]} if parts else None
    t_channel = statistics.median(channel_times[3:]) if channel_times else None
    t_channel_ipc = statistics.median(channel_ipc_times[3:]) if channel_ipc_times else None
    t_channel_batch = statistics.median(channel_batch_times[3:]) if channel_batch_times else None
    return (statistics.median(times[3:]), med, statistics.median(stream_times[3:]), t_channel, channel_parts,
            t_channel_ipc, t_channel_batch, statistics.median(unary_batch_times[3:]))


async def unary_step_bytes(client, target: str, batch) -> tuple[list[bytes], bool, bytes]:
    """(the serialized messages client.propose_batch(batch) sends by gRPC, whether on ProposeChunked, the drafter's
    serialized reply to them): the request built as the client builds it (columns from COLUMNS_MIN_SEQUENCES
    sequences, ProposeChunked from its chunk_min_bytes; a client without a step channel, one upload stream), then
    sent once as it is, to learn the reply's size (bench_step --grpc-floor)."""
    import grpc

    from drafter_client.batch import COLUMNS_MIN_SEQUENCES, serialize_batch
    from drafter_client.benchmarks.bare_grpc import LARGE_MESSAGES
    from drafter_client.messages import ChunkedRequest

    columns = len(batch) >= COLUMNS_MIN_SEQUENCES and (await client.get_info()).step_columns_supported
    payload = serialize_batch(client.namespace, batch, None, 1, client.chunk_min_bytes, columns)
    chunked = isinstance(payload, ChunkedRequest)
    messages = list(payload.messages(client.chunk_bytes)) if chunked else [bytes(payload)]
    identity = dict(request_serializer=None, response_deserializer=None)
    async with grpc.aio.insecure_channel(target, options=LARGE_MESSAGES) as ch:
        if chunked:
            async def pieces():
                for message in messages:
                    yield message
            reply = await ch.stream_unary("/drafter.v1.Drafter/ProposeChunked", **identity)(pieces())
        else:
            reply = await ch.unary_unary("/drafter.v1.Drafter/Propose", **identity)(messages[0])
    return messages, chunked, reply


def engine_work(ms: float) -> None:
    """The engine's own work between two of its steps (its target's forward), as a spin of ms milliseconds on the
    calling thread: the next step then runs as long after the last one as in a serving engine's loop, where the host
    code of both processes has gone cold (docs/performance.md, twenty-fifth session)."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


async def bench_rounds(rt, target, batch, context, m, k, iters, width, vocab, rounds: int,
                       upload_streams: int | None = None, bare: str | None = None,
                       metrics_port: int | None = None, engine_gap_ms: float = 0.0) -> dict[str, list[float]]:
    """The step channel against the in-process step in alternating rounds (the in-process runtime rt alive beside
    the drafter): each round times iters steps of each of the in-process proposer (one StepInput per sequence, host
    states; then the same step as columns, one BatchInput through Proposer.step_batch, host states), propose()
    through a step channel, propose_batch() through it and propose_batch() by unary gRPC (a second client, no
    channel), one after the other, so that the ratios of a round come from the same minute of the machine.
    upload_streams: the unary client's (DrafterClient's default when None). bare: the address of a bare_grpc server:
    each round then also times the unary step's request and reply bytes through it ("bare_grpc", the transport
    alone). metrics_port: the drafter's; each round then also reads the drafter's own step (its step worker's seconds
    per batch, from /metrics before and after) through the channel, both APIs ("drafter_step",
    "drafter_step_batch_api"), and the in-process steps' means over the same number of steps ("in_process_mean",
    "in_process_columns_mean"): like for like, minutes apart no more. engine_gap_ms: before each step of every path,
    the engine's own work (engine_work, outside the timed call). Returns each one's median per round
    (seconds; the drafter's and the in-process means: means over all iters + 3 steps, warm-up included, as the
    drafter's counters see them)."""
    import contextlib

    import grpc

    from drafter_client import DrafterClient
    from drafter_client.benchmarks.bare_grpc import LARGE_MESSAGES, BareClient
    from drafter_client.messages import build_request

    prefill, decode = make_steps(batch, context, m, k, width, vocab, seed=batch)
    run_prefill(rt, prefill)
    inputs = to_inputs(decode)
    batch_inputs = to_batch_input(decode)
    as_batch = as_step_batch(decode)
    result = {"in_process": [], "in_process_columns": [], "channel": [], "channel_batch_api": [],
              "unary_batch_api": []}
    if bare is not None:
        result["bare_grpc"] = []
    if metrics_port is not None:
        result.update(in_process_mean=[], in_process_columns_mean=[], drafter_step=[], drafter_step_batch_api=[])
    async with DrafterClient(target, namespace="bench", step_timeout_s=None) as c, \
            DrafterClient(target, namespace="bench", step_timeout_s=None,
                          **({} if upload_streams is None else {"upload_streams": upload_streams})) as unary, \
            contextlib.AsyncExitStack() as stack:
        await c.wait_ready(600)  # (with --rounds-only nothing waited for the drafter's start before)
        for chunk in range(0, batch, 8):
            r = await c.propose(prefill[chunk : chunk + 8])
            assert all(s.ok for s in r.sequences), r.sequences[0].message
        if bare is not None:
            bare_client = BareClient(await stack.enter_async_context(
                grpc.aio.insecure_channel(bare, options=LARGE_MESSAGES)))
            unary_messages, chunked, reply = await unary_step_bytes(unary, target, as_batch)
            reply_bytes = len(reply)
        request_bytes = max(16 * 2**20, 2 * build_request("bench", decode, None).ByteSize())
        assert await c.open_step_channel(request_bytes=request_bytes), "no step channel"
        means = []  # the mean of median_step's last run, all its steps

        async def median_step(call) -> tuple[float, object]:  # (seconds per step after 3 warm-up steps, last answer)
            times = []
            for _ in range(iters + 3):
                engine_work(engine_gap_ms)
                t0 = time.perf_counter()
                answer = call()
                if asyncio.iscoroutine(answer):
                    answer = await answer
                times.append(time.perf_counter() - t0)
            means.append(statistics.fmean(times))
            return statistics.median(times[3:]), answer

        async def drafter_step(call) -> tuple[float, object, float | None]:
            """median_step through the drafter, and its step worker's mean seconds per batch over those steps."""
            before = scrape_server_seconds(metrics_port) if metrics_port is not None else None
            t, answer = await median_step(call)
            if before is None:
                return t, answer, None
            after = scrape_server_seconds(metrics_port)
            batches = after["batches"] - before["batches"]
            assert batches == iters + 3, (batches, iters)  # (one client, one batch a step: nothing merged or lost)
            return t, answer, (after["worker"] - before["worker"]) / batches

        for _ in range(rounds):
            t, out = await median_step(lambda: rt.proposer.step(inputs))
            assert all(o.code == 0 and len(o.drafts) == k for o in out), out[0].message
            result["in_process"].append(t)
            in_process_mean = means[-1]
            t, out = await median_step(lambda: rt.proposer.step_batch(batch_inputs))
            assert all(o.code == 0 and len(o.drafts) == k for o in out.to_outputs()), out.messages
            result["in_process_columns"].append(t)
            in_process_columns_mean = means[-1]
            t, r, worker = await drafter_step(lambda: c.propose(decode))
            assert all(s.ok and s.drafts.numel() == k for s in r.sequences)
            result["channel"].append(t)
            t, r, worker_batch_api = await drafter_step(lambda: c.propose_batch(as_batch))
            assert not r.fallback and int(r.codes.abs().sum()) == 0 and bool((r.num_drafts == k).all())
            result["channel_batch_api"].append(t)
            if metrics_port is not None:
                result["in_process_mean"].append(in_process_mean)
                result["in_process_columns_mean"].append(in_process_columns_mean)
                result["drafter_step"].append(worker)
                result["drafter_step_batch_api"].append(worker_batch_api)
            t, r = await median_step(lambda: unary.propose_batch(as_batch))
            assert not r.fallback and int(r.codes.abs().sum()) == 0 and bool((r.num_drafts == k).all())
            result["unary_batch_api"].append(t)
            if bare is not None:  # the same bytes both ways through gRPC alone
                t, _ = await median_step(lambda: bare_client.round_trip(unary_messages, chunked, reply_bytes))
                result["bare_grpc"].append(t)
        assert unary.steps_through_channel == 0
        assert c.steps_through_channel == 2 * rounds * (iters + 3), "every step should have gone through the channel"
        c.close_step_channel()
        await c.release([s.sequence_id for s in decode])
    for s in decode:
        rt.proposer.table.release("bench", s.sequence_id)
    return result


def prefill_step(tokens: int, width: int, vocab: int, sequence_id: str = "prefill"):
    """One sequence, one step holding a whole prompt of `tokens` committed tokens (k = 0)."""
    from drafter_client import SequenceStep

    g = torch.Generator().manual_seed(tokens)
    toks = torch.randint(0, vocab, (tokens + 1,), generator=g)
    hid = torch.randn(tokens, width, generator=g).to(torch.bfloat16)
    return SequenceStep(sequence_id, 0, toks[:tokens], hid, int(toks[tokens]), 0)


def bench_prefill_in_process(rt, tokens, iters, width, vocab) -> float:
    inputs = to_inputs([prefill_step(tokens, width, vocab)])
    times = []
    for _ in range(iters + 2):
        t0 = time.perf_counter()
        out = rt.proposer.step(inputs)
        if rt.device.type == "cuda":  # a k = 0 step copies nothing back, so nothing else waits for the GPU
            torch.cuda.synchronize(rt.device)
        times.append(time.perf_counter() - t0)
        assert out[0].code == 0, out[0].message
    rt.proposer.table.release("bench", "prefill")
    return statistics.median(times[2:])


async def bench_prefill_sidecar(target, tokens, iters, width, vocab, channel: bool = False) -> float:
    """Median seconds of one prompt step with its states inline: a unary Propose, or (channel) a step channel
    whose request area holds the whole message."""
    from drafter_client import DrafterClient

    step = prefill_step(tokens, width, vocab)
    async with DrafterClient(target, namespace="bench", step_timeout_s=None) as c:
        if channel:
            assert await c.open_step_channel(request_bytes=tokens * width * 2 + tokens * 8 + 2**20)
        times = []
        for _ in range(iters + 2):
            t0 = time.perf_counter()
            r = await c.propose([step])
            times.append(time.perf_counter() - t0)
            assert r.sequences[0].ok, r.sequences[0].message
        assert c.steps_through_channel == (iters + 2 if channel else 0)
        await c.release(["prefill"])
    return statistics.median(times[2:])


def cpu_list(text: str) -> set[int]:
    """"2", "4-9" or "2,4-5" -> the set of CPU numbers."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=None)
    ap.add_argument("--prefill-tokens", type=int, default=4096,
                    help="also time one prompt of this many tokens in one step (hidden-state ingestion); 0 = skip")
    ap.add_argument("--metrics-port", type=int, default=None,
                    help="the server's metrics port, scraped to split sidecar time into worker and RPC (default: a "
                         "free port)")
    ap.add_argument("--m", type=int, default=3, help="committed tokens per sequence per step (1 + accepted)")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="CUDA: decode steps from CUDA graphs (in-process and sidecar)")
    ap.add_argument("--graphs-ab", action="store_true",
                    help="CUDA: also time the in-process proposer with --no-cuda-graphs (column eager ms)")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU: torch threads of the in-process proposer and of the drafter (--cpu-threads), the same "
                         "for both (default: half the cores, the other half being the engine's, as drafter-demo "
                         "does; 0: torch's default, one per core, in both)")
    ap.add_argument("--engine-applies-fc", action="store_true",
                    help="EAGLE-3 presets: the drafter (in-process and sidecar) runs with --engine-applies-fc and the "
                         "steps carry [T, H] states; the engine's own fc GEMM per step is timed apart (engine_fc_ms)")
    ap.add_argument("--drafter-flag", action="append", default=[],
                    help="an extra drafter-serve flag for the sidecar runs, e.g. --drafter-flag=--step-channel-"
                         "checksums=on (repeatable)")
    ap.add_argument("--rounds", type=int, default=0,
                    help="after the table: this many alternating rounds of the in-process step, the step channel and "
                         "the batch API through it, per batch size (the in-process runtime then stays alive beside "
                         "the drafter); the ratios' median and spread go in the JSON (0: none)")
    ap.add_argument("--rounds-only", action="store_true",
                    help="with --rounds: skip the single pass through the sidecar (unary, stream, step channel, batch "
                         "API, CUDA IPC) and time only the in-process step and the rounds")
    ap.add_argument("--engine-gap-ms", type=float, default=0.0,
                    help="with --rounds: before each step of every path the engine's own work, a spin of this many "
                         "ms (a target's forward between two steps; default 0: steps back to back)")
    ap.add_argument("--upload-streams", type=int, default=None,
                    help="the rounds' unary batch API: DrafterClient(upload_streams=N) (default: the client's, 1)")
    ap.add_argument("--grpc-floor", action="store_true",
                    help="with --rounds: each round also sends the unary batch API's request and reply bytes through a "
                         "bare grpc.aio server (bare_grpc.py); in-process + that round trip is the unary path's floor")
    ap.add_argument("--client-cpus", default=None,
                    help="Linux: CPUs this process (the engine side and the in-process step) runs on, e.g. 2 or 2-3 "
                         "(default: all)")
    ap.add_argument("--drafter-cpus", default=None,
                    help="Linux: CPUs the drafter-serve subprocess runs on, e.g. 4-9 (default: all)")
    ap.add_argument("--out", default="bench_out/bench_step.json")
    a = ap.parse_args(argv)
    if a.metrics_port is None:
        a.metrics_port = free_port()
    if a.rounds_only and not a.rounds:
        ap.error("--rounds-only needs --rounds N")
    if a.grpc_floor and not a.rounds:
        ap.error("--grpc-floor needs --rounds N")
    if a.engine_gap_ms and not a.rounds:
        ap.error("--engine-gap-ms needs --rounds N")
    if a.engine_gap_ms < 0:
        ap.error("--engine-gap-ms must be >= 0")
    if a.grpc_floor and (a.upload_streams or 1) != 1:
        ap.error("--grpc-floor times one upload stream (the bare server's Upload is one call)")
    if a.client_cpus:
        os.sched_setaffinity(0, cpu_list(a.client_cpus))
        print(f"this process runs on CPUs {sorted(os.sched_getaffinity(0))}", flush=True)
    shape = PRESETS[a.preset]
    if a.engine_applies_fc and shape.get("method") != "eagle3":
        ap.error(f"--engine-applies-fc is for EAGLE-3 presets; {a.preset} is not one")
    if a.engine_applies_fc:
        a.drafter_flag = ["--engine-applies-fc", *a.drafter_flag]
    context = a.context or shape["context"]
    batches = [int(b) for b in a.batches.split(",")]
    device = torch.device(a.device)
    dtype = a.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype_bytes = 2 if dtype in ("bfloat16", "float16") else 4
    max_len = max(context, a.prefill_tokens) + 64
    kv_tokens = (max(batches) + 8) * (context + 96) + max_len
    threads = None  # CPU: torch threads of both the in-process proposer and the drafter (None: torch's default)
    if device.type == "cpu":
        threads = a.threads if a.threads is not None else max(1, (os.cpu_count() or 2) // 2)
        if threads:
            torch.set_num_threads(threads)
            a.drafter_flag = [f"--cpu-threads={threads}", *a.drafter_flag]
        print(f"CPU: {torch.get_num_threads()} torch thread(s) in-process and in the drafter", flush=True)
    from drafter_service.runtime import build_runtime

    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    started = datetime.datetime.now().isoformat(timespec="seconds")
    rows: list[dict] = []
    prefill = None
    bw = None

    def save(complete: bool) -> dict:
        """The JSON as it stands: written after each batch size's sidecar runs and rounds too (complete False), so
        that a run stopped by a time limit keeps what it measured."""
        result = dict(benchmark="bench_step", date=started, complete=complete,
                      device=f"{device.type}: {dev_name}, {os.cpu_count()} cores", torch=torch.__version__,
                      command=" ".join(shlex.quote(x) for x in (sys.argv if argv is None else ["bench_step", *argv])), drafter_flags=a.drafter_flag,
                      preset=a.preset, shape=shape, dtype=dtype, context=context, m=a.m, k=a.k, iters=a.iters,
                      cuda_graphs=a.cuda_graphs and device.type == "cuda",
                      bandwidth_gbps=bw / 1e9 if bw else None, rows=rows,
                      cpu_threads=torch.get_num_threads(),  # host threads of the in-process proposer
                      prefill=prefill, rounds=a.rounds, rounds_only=a.rounds_only, engine_gap_ms=a.engine_gap_ms,
                      engine_applies_fc=a.engine_applies_fc,
                      upload_streams=a.upload_streams if a.upload_streams is not None else "client default")
        write_json(a.out, result, say=False)
        return result

    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        print(f"writing a random {a.preset} head ...", flush=True)
        cfg = random_head_config(tmp, shape, max_len, device=a.device, dtype=dtype, kv_cache_tokens=kv_tokens,
                                 max_batch_seqs=4096, cuda_graphs=a.cuda_graphs, engine_applies_fc=a.engine_applies_fc)
        head, target = pathlib.Path(cfg.model), pathlib.Path(cfg.target_model)
        bw = measure_bandwidth(device)
        print(f"memory bandwidth (copy, read+write): {bw / 1e9:.1f} GB/s", flush=True)
        rt = build_runtime(cfg)
        width = rt.limits.hidden_states_width
        for b in batches:
            t = bench_in_process(rt, b, context, a.m, a.k, a.iters, shape["vocab_size"])
            fb = floor_bytes(shape, dtype_bytes, b, context, a.m, a.k, a.engine_applies_fc)
            rows.append(dict(batch=b, in_process_ms=t * 1e3, floor_ms=fb / bw * 1e3, floor_bytes=fb,
                             in_process_over_floor=t * 1e3 / (fb / bw * 1e3)))
            print(f"in-process batch {b}: {t * 1e3:.2f} ms", flush=True)
            if a.engine_applies_fc:  # what the engine now does per step instead: fc over its [b * m, 3H] states
                rows[-1]["engine_fc_ms"] = time_engine_fc(head, b * a.m, device, dtype, a.iters) * 1e3
                print(f"the engine's fc for batch {b} ({b * a.m} rows): {rows[-1]['engine_fc_ms']:.3f} ms",
                      flush=True)
            t = bench_in_process(rt, b, context, a.m, a.k, a.iters, shape["vocab_size"], columns=True)
            rows[-1]["in_process_columns_ms"] = t * 1e3
            print(f"in-process batch {b}, as columns (step_batch): {t * 1e3:.2f} ms", flush=True)
            if device.type == "cuda":  # the same step with the states already on the GPU (no host staging)
                t = bench_in_process(rt, b, context, a.m, a.k, a.iters, shape["vocab_size"], device)
                rows[-1]["in_process_states_on_gpu_ms"] = t * 1e3
                print(f"in-process batch {b}, states on the GPU: {t * 1e3:.2f} ms", flush=True)
                t = bench_in_process(rt, b, context, a.m, a.k, a.iters, shape["vocab_size"], device,
                                     columns=True)
                rows[-1]["in_process_columns_states_on_gpu_ms"] = t * 1e3
                print(f"in-process batch {b}, as columns, states on the GPU: {t * 1e3:.2f} ms", flush=True)
        if a.prefill_tokens:
            hidden_bytes = a.prefill_tokens * width * 2  # bf16 on the wire
            t = bench_prefill_in_process(rt, a.prefill_tokens, a.iters, width, shape["vocab_size"])
            prefill = dict(tokens=a.prefill_tokens, hidden_bytes=hidden_bytes, in_process_ms=t * 1e3,
                           in_process_gbps=hidden_bytes / t / 1e9)
            print(f"in-process prefill {a.prefill_tokens}: {t * 1e3:.2f} ms", flush=True)
        if not a.rounds:  # (with rounds it runs again beside the drafter)
            del rt
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if a.graphs_ab and device.type == "cuda":
            eager = build_runtime(dataclasses.replace(cfg, cuda_graphs=False))
            for row in rows:
                t = bench_in_process(eager, row["batch"], context, a.m, a.k, a.iters, shape["vocab_size"])
                row["in_process_eager_ms"] = t * 1e3
                print(f"in-process, no CUDA graphs, batch {row['batch']}: {t * 1e3:.2f} ms", flush=True)
            del eager
            torch.cuda.empty_cache()
        sock = tmp / "bench.sock"
        cmd = [sys.executable, "-m", "drafter_service.cli", "--model", str(head), "--target-model", str(target),
               "--listen", f"unix:{sock}", "--device", a.device, "--dtype", dtype, "--kv-cache-tokens",
               str(kv_tokens), "--max-model-len", str(max_len), "--max-batch-seqs", "4096", "--log-level", "WARNING",
               "--cuda-graphs" if a.cuda_graphs else "--no-cuda-graphs", "--metrics-port", str(a.metrics_port),
               *a.drafter_flag]
        drafter_cpus = cpu_list(a.drafter_cpus) if a.drafter_cpus else None
        server = subprocess.Popen(cmd, preexec_fn=(lambda: os.sched_setaffinity(0, drafter_cpus)) if drafter_cpus
                                  else None)
        bare = None
        try:
            # (fails at once if the drafter exits at start, e.g. a port in use: its log is on this stderr)
            wait_serving(f"unix:{sock}", server, 600, lambda: "(above, on this process's stderr)")
            if a.grpc_floor:  # (spawned: this process holds a CUDA context)
                from drafter_client.benchmarks.bare_grpc import BareServer
                bare = BareServer(f"unix:{tmp / 'bare.sock'}")
            for row in rows if not a.rounds_only else []:
                b = row["batch"]
                t, parts, t_stream, t_channel, ch_parts, t_ipc, t_batch, t_unary_batch = asyncio.run(bench_sidecar(
                    f"unix:{sock}", b, context, a.m, a.k, a.iters, width, shape["vocab_size"], a.metrics_port, device))
                # server side: the proposer step alone (worker), and the Propose handler by phase; what the
                # client sees beyond parse + wait + reply is gRPC transport plus the client's own packing/parsing
                row.update(sidecar_worker_ms=parts["worker"] * 1e3, server_parse_ms=parts["parse"] * 1e3,
                           server_wait_ms=parts["wait"] * 1e3, server_reply_ms=parts["reply"] * 1e3,
                           transport_and_client_ms=(t - parts["parse"] - parts["wait"] - parts["reply"]) * 1e3)
                payload = b * a.m * width * 2 + b * a.m * 8
                row.update(sidecar_ms=t * 1e3, sidecar_stream_ms=t_stream * 1e3, payload_bytes=payload,
                           sidecar_over_in_process=t * 1e3 / row["in_process_ms"],
                           sidecar_batch_api_ms=t_unary_batch * 1e3,
                           batch_api_over_in_process=t_unary_batch * 1e3 / row["in_process_ms"])
                if t_channel is not None:
                    row.update(sidecar_channel_ms=t_channel * 1e3,
                               channel_over_in_process=t_channel * 1e3 / row["in_process_ms"])
                if t_batch is not None:
                    row.update(sidecar_channel_batch_api_ms=t_batch * 1e3,
                               channel_batch_api_over_in_process=t_batch * 1e3 / row["in_process_ms"])
                if t_ipc is not None:
                    row.update(sidecar_channel_cuda_ipc_ms=t_ipc * 1e3,
                               channel_cuda_ipc_over_in_process=t_ipc * 1e3 / row["in_process_ms"])
                if ch_parts:  # means per channel step, server side: the proposer step, and parse/wait/reply
                    row.update(channel_worker_ms=ch_parts["worker"] * 1e3, channel_parse_ms=ch_parts["parse"] * 1e3,
                               channel_wait_ms=ch_parts["wait"] * 1e3, channel_reply_ms=ch_parts["reply"] * 1e3,
                               channel_worker_over_in_process=ch_parts["worker"] * 1e3 / row["in_process_ms"])
                    print(f"  channel, server side (mean): worker {ch_parts['worker'] * 1e3:.3f} ms, parse "
                          f"{ch_parts['parse'] * 1e3:.3f}, wait {ch_parts['wait'] * 1e3:.3f}, reply "
                          f"{ch_parts['reply'] * 1e3:.3f}", flush=True)
                print(f"sidecar batch {b}: {t * 1e3:.2f} ms (batch API by unary gRPC: {t_unary_batch * 1e3:.2f} ms, "
                      f"on one stream: {t_stream * 1e3:.2f} ms, through a step "
                      f"channel: {t_channel * 1e3 if t_channel else float('nan'):.2f} ms, batch API through it: "
                      f"{t_batch * 1e3 if t_batch else float('nan'):.2f} ms, channel + CUDA IPC: "
                      f"{t_ipc * 1e3 if t_ipc else float('nan'):.2f} ms)", flush=True)
                save(complete=False)
            if prefill:
                t = asyncio.run(bench_prefill_sidecar(f"unix:{sock}", a.prefill_tokens, a.iters, width,
                                                      shape["vocab_size"]))
                prefill.update(sidecar_ms=t * 1e3, sidecar_gbps=prefill["hidden_bytes"] / t / 1e9)
                t = asyncio.run(bench_prefill_sidecar(f"unix:{sock}", a.prefill_tokens, a.iters, width,
                                                      shape["vocab_size"], channel=True))
                prefill.update(channel_ms=t * 1e3, channel_gbps=prefill["hidden_bytes"] / t / 1e9)
            for row in rows if a.rounds else []:
                got = asyncio.run(bench_rounds(rt, f"unix:{sock}", row["batch"], context, a.m, a.k, a.iters, width,
                                               shape["vocab_size"], a.rounds, a.upload_streams,
                                               bare.address if bare else None, a.metrics_port, a.engine_gap_ms))
                ratios = {f"{name}_over_in_process": [t / t_in for t, t_in in zip(got[name], got["in_process"])]
                          for name in ("channel", "channel_batch_api", "unary_batch_api")}
                # like for like: the batch API (columns in and out) against the in-process step from columns
                ratios.update({f"{name}_over_in_process_columns": [t / t_in for t, t_in in
                                                                   zip(got[name], got["in_process_columns"])]
                               for name in ("channel_batch_api", "unary_batch_api")})
                if "drafter_step" in got:  # the drafter's own step (its worker, inside the sidecar), like for like
                    ratios["drafter_step_over_in_process"] = [
                        t / t_in for t, t_in in zip(got["drafter_step"], got["in_process_mean"])]
                    ratios["drafter_step_batch_api_over_in_process_columns"] = [
                        t / t_in for t, t_in in zip(got["drafter_step_batch_api"], got["in_process_columns_mean"])]
                if bare is not None:  # the unary path's floor: the in-process step plus gRPC's round trip alone
                    ratios["unary_floor_over_in_process_columns"] = [
                        (t_in + t) / t_in for t, t_in in zip(got["bare_grpc"], got["in_process_columns"])]
                row["rounds"] = dict({f"{name}_ms": [t * 1e3 for t in ts] for name, ts in got.items()}, **ratios)
                row["rounds_median"] = {name: statistics.median(r) for name, r in ratios.items()}
                print(f"rounds, batch {row['batch']}: "
                      + ", ".join(f"{name} {' '.join(f'{x:.2f}' for x in r)} (median {statistics.median(r):.2f})"
                                  for name, r in ratios.items()), flush=True)
                save(complete=False)
        finally:
            if bare is not None:
                bare.close()
            server.terminate()
            server.wait(60)
    result = save(complete=True)
    out = pathlib.Path(a.out)
    print(f"\n{result['device']}, {a.preset}, {dtype}, context {context}, m={a.m}, k={a.k}, {result['date']}")
    ab = all("in_process_eager_ms" in r for r in rows)
    gpu_states = all("in_process_states_on_gpu_ms" in r for r in rows)
    if a.rounds_only:  # no single pass through the sidecar: the in-process step and its floor
        print(f"{'batch':>5} {'in-proc ms':>11} {'in, columns':>11}" + (f" {'cols, GPU st.':>13}" if gpu_states else "")
              + f" {'floor ms':>9} {'in/floor':>9}" + (f" {'best/floor':>10}" if gpu_states else ""))
        for r in rows:
            print(f"{r['batch']:>5} {r['in_process_ms']:>11.2f} {r['in_process_columns_ms']:>11.2f}"
                  + (f" {r['in_process_columns_states_on_gpu_ms']:>13.2f}" if gpu_states else "")
                  + f" {r['floor_ms']:>9.3f} {r['in_process_over_floor']:>9.2f}"
                  + (f" {r['in_process_columns_states_on_gpu_ms'] / r['floor_ms']:>10.2f}" if gpu_states else ""))
    else:
        print(f"{'batch':>5} {'in-proc ms':>11} {'sidecar ms':>11} {'side/in':>8} {'ubatch ms':>9} {'ubat/in':>7} "
              f"{'stream ms':>10} {'channel ms':>10} "
              f"{'chan/in':>8} {'batch ms':>9} {'bat/in':>7} {'ch+IPC ms':>10} {'floor ms':>9} {'in/floor':>9} "
              f"{'payload KB':>11} {'srv worker':>10} {'ch worker':>9} {'chw/in':>7} {'srv parse':>9} {'srv wait':>9} "
              f"{'srv reply':>9} {'transport':>9}"
              + (f" {'eager ms':>9}" if ab else "") + (f" {'in, GPU states':>14}" if gpu_states else "")
              + f" {'in, columns':>11}" + (f" {'cols, GPU st.':>13}" if gpu_states else ""))
        for r in rows:
            print(f"{r['batch']:>5} {r['in_process_ms']:>11.2f} {r['sidecar_ms']:>11.2f} "
                  f"{r['sidecar_over_in_process']:>8.2f} {r['sidecar_batch_api_ms']:>9.2f} "
                  f"{r['batch_api_over_in_process']:>7.2f} {r['sidecar_stream_ms']:>10.2f} "
                  f"{r.get('sidecar_channel_ms', float('nan')):>10.2f} {r.get('channel_over_in_process', float('nan')):>8.2f} "
                  f"{r.get('sidecar_channel_batch_api_ms', float('nan')):>9.2f} "
                  f"{r.get('channel_batch_api_over_in_process', float('nan')):>7.2f} "
                  f"{r.get('sidecar_channel_cuda_ipc_ms', float('nan')):>10.2f} {r['floor_ms']:>9.3f} "
                  f"{r['in_process_over_floor']:>9.2f} "
                  f"{r['payload_bytes'] / 1024:>11.1f} {r['sidecar_worker_ms']:>10.2f} "
                  f"{r.get('channel_worker_ms', float('nan')):>9.2f} "
                  f"{r.get('channel_worker_over_in_process', float('nan')):>7.2f} {r['server_parse_ms']:>9.2f} "
                  f"{r['server_wait_ms']:>9.2f} {r['server_reply_ms']:>9.2f} {r['transport_and_client_ms']:>9.2f}"
                  + (f" {r['in_process_eager_ms']:>9.2f}" if ab else "")
                  + (f" {r['in_process_states_on_gpu_ms']:>14.2f}" if gpu_states else "")
                  + f" {r['in_process_columns_ms']:>11.2f}"
                  + (f" {r['in_process_columns_states_on_gpu_ms']:>13.2f}" if gpu_states else ""))
    if prefill:
        print(f"prefill of {prefill['tokens']} tokens ({prefill['hidden_bytes'] / 2**20:.1f} MiB of hidden states, "
              f"inline bytes): in-process {prefill['in_process_ms']:.1f} ms ({prefill['in_process_gbps']:.2f} GB/s), "
              f"sidecar {prefill['sidecar_ms']:.1f} ms ({prefill['sidecar_gbps']:.2f} GB/s), through a step channel "
              f"{prefill['channel_ms']:.1f} ms ({prefill['channel_gbps']:.2f} GB/s)")
    if a.rounds:
        print(f"{a.rounds} alternating rounds of {a.iters} steps each (per round: in-process per sequence, in-process "
              "from columns, the step channel, the batch API through it, the batch API by unary gRPC"
              + (", the unary request's bytes through a bare grpc.aio server" if a.grpc_floor else "")
              + "); ratios, median [min, max]: the per-sequence API (propose) to the in-process step per sequence "
              "(Proposer.step), the batch API (columns) to the in-process step from columns (Proposer.step_batch):")
        cols = [("channel_over_in_process", "channel / in"),
                ("channel_batch_api_over_in_process_columns", "batch API, chan. / cols"),
                ("unary_batch_api_over_in_process_columns", "unary batch API / cols")]
        if a.grpc_floor:
            cols.append(("unary_floor_over_in_process_columns", "unary floor / cols"))
        if all("drafter_step_batch_api_over_in_process_columns" in r["rounds"] for r in rows):
            cols.append(("drafter_step_batch_api_over_in_process_columns", "drafter's step / cols"))
        print(f"{'batch':>5} {'in-proc ms':>11} {'in, cols ms':>11}" + "".join(f" {title:>24}" for _, title in cols)
              + (f" {'bare gRPC ms':>12}" if a.grpc_floor else ""))
        for r in rows:
            cells = ""
            for key, _ in cols:
                x = r["rounds"][key]
                cells += f" {statistics.median(x):>10.2f} [{min(x):.2f}, {max(x):.2f}]"
            if a.grpc_floor:
                cells += f" {statistics.median(r['rounds']['bare_grpc_ms']):>12.2f}"
            print(f"{r['batch']:>5} {statistics.median(r['rounds']['in_process_ms']):>11.2f} "
                  f"{statistics.median(r['rounds']['in_process_columns_ms']):>11.2f}{cells}")
        if any(key.startswith("drafter_step") for key, _ in cols):
            print("drafter's step: the drafter's own step (its step worker's seconds per batch, from its /metrics) for "
                  "the batch API through the channel, over the in-process step from columns, means over the same "
                  "steps, round by round")
        if a.grpc_floor:
            print("unary floor: the in-process step from columns plus the unary request's and reply's bytes through a "
                  "bare grpc.aio server (bare_grpc.py), round by round: while the step waits for the whole request, no "
                  "Python of the drafter's or the client's can bring the unary batch API below it")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
