"""Build everything a server needs from a ServerConfig: device, model, KV pool, proposer, limits."""
import ctypes
import logging
import time
from dataclasses import dataclass, field

import torch

from drafter_kernels import ops, paged_attention, sampling

from drafter_service import __version__
from drafter_service.config import ServerConfig
from drafter_service.engine.cuda_graphs import capture_decode_graphs
from drafter_service.engine.kv_cache import KVCache
from drafter_service.loader import DTYPES, load_head
from drafter_service.metrics import Metrics
from drafter_service.engine.predraft import MAX_PREDRAFT_BRANCHES, PredraftCounters
from drafter_service.engine.proposer import Proposer
from drafter_service.engine.sequence import SequenceLimits
from drafter_service.engine.step_io import StepInput
from drafter_service.transport.validation import Limits

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_TOKENS = 131072
MAX_TOP_K_PROBS = 256


@dataclass
class Runtime:
    config: ServerConfig
    device: torch.device
    dtype: torch.dtype
    model_name: str
    model: object
    kv: KVCache
    proposer: Proposer
    limits: Limits
    max_model_len: int
    metrics: Metrics
    hidden_states_source: str
    target_layer_ids: list[int] = field(default_factory=list)


def max_top_k_probs(model) -> int:
    """The most top-N pairs a draft may ask for (GetInfo.max_top_k_probs): MAX_TOP_K_PROBS, or the draft vocabulary
    where it is smaller."""
    return min(MAX_TOP_K_PROBS, model.draft_vocab_size)


def pick_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch sees no CUDA device")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name!r}: only cpu and cuda are supported")
    return dev


def pick_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"--dtype {name!r}: choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _kv_tokens(cfg: ServerConfig, device: torch.device, bytes_per_token: int) -> int:
    if cfg.kv_cache_tokens is not None:
        return cfg.kv_cache_tokens
    if device.type != "cuda":
        return CPU_DEFAULT_KV_TOKENS
    total = torch.cuda.get_device_properties(device).total_memory
    budget = int(total * cfg.gpu_memory_fraction) - torch.cuda.memory_allocated(device)
    return max(0, budget // bytes_per_token)


def warm_up(proposer: Proposer, width: int, k: int) -> None:
    """Run a few throw-away steps before health turns SERVING, so that the first real steps find the Triton kernels
    compiled (a kernel compiles at its first launch with each new specialization: seconds, past any engine's step
    deadline): a prefill chunk, greedy decode steps of one and of several sequences, a sampled step with
    log-probabilities and top-k, and (sequential heads) pre-drafting steps of one and of four sequences, each with
    its preparation pass, a step its branches answer (a hit) and the pass after it, over short and long contexts.
    Before them (Triton on the device), every variant of the attention and argmax kernels is launched once on
    throw-away inputs (paged_attention.compile_variants, sampling.compile_argmax_variants): the steps that would reach
    some variants, a first step of 5-8 rows over a context long enough to split, say, come only with the engine's
    traffic. Their sequences are released and their
    counts kept out of the metrics and of pre-drafting's estimates."""
    t0 = time.perf_counter()
    metrics, proposer.metrics = proposer.metrics, Metrics()
    ns = "\x00warm-up"  # (before any client is served; everything it creates is released below)
    m = min(40, proposer.max_model_len - k - 8)
    # (at 40 positions the attention of a pass runs unsplit; from ~65 it splits the context, a kernel variant of its
    # own that an H200's EAGLE-1 passes compiled mid-run, 0.37-0.6 s, after a warm-up with short contexts only)
    long = min(320, proposer.max_model_len - 2 * k - 16, proposer.kv.capacity_tokens // 12)  # (a small pool: fewer)

    def step(sid, p, n, **sampling):
        g = torch.Generator().manual_seed(len(sid) + p)
        return StepInput(ns, sid, p, torch.randint(0, 100, (n,), generator=g, dtype=torch.int64),
                         torch.randn(n, width, generator=g, dtype=torch.float32), 1, k if p else 0, **sampling)

    def hits_of(batch: list[StepInput]) -> list[StepInput]:
        """For each sequence of batch, the next step that one of its prepared branches answers ([] if one has none)."""
        hits = []
        for s in batch:
            seq = proposer.table.get(ns, s.sequence_id)
            br = seq.predraft.branches if seq is not None and seq.predraft is not None else None
            if br is None or not br.outcomes:
                return []
            a, b = next(iter(br.outcomes))
            hits.append(StepInput(ns, s.sequence_id, br.base, torch.tensor([br.next_token] + br.served[:a]),
                                  torch.randn(a + 1, width), b, br.num_drafts, predraft_branches=8))
        return hits

    pd = proposer.predraft
    counters, pd.counters = pd.counters, PredraftCounters()
    min_all_hit, pd.odds.min_all_hit = pd.odds.min_all_hit, 0.0  # (every warm-up pass runs)
    variants = 0
    if ops.use_triton(proposer.kv.kv):
        # every attention kernel variant the steps below may not reach (a first step of 5-8 rows over a split
        # context after a pre-drafting miss, the reduce over 16 splits ...): compiled now, not inside a real step;
        # and the argmax's (a pre-drafting pass's eager argmax over up to 64 branches per sequence; the KV pool holds
        # the model's dtype, which the logits have)
        try:
            k_cache, v_cache = proposer.kv_layers[0]
            variants = paged_attention.compile_variants(k_cache, v_cache, proposer.model.dims.num_heads,
                                                        proposer.max_model_len, proposer.kv.kv.dtype)
            variants += sampling.compile_argmax_variants(proposer.model.draft_vocab_size, proposer.kv.kv.dtype,
                                                         proposer.kv.kv.device)
        except Exception:  # (best effort, as the steps below)
            log.exception("warm-up of the kernel variants failed: the first real steps may compile kernels")
    try:
        batches = [[step(f"s{i}", 0, m) for i in range(4)],  # prefill chunks
                   [step("s0", m, 1)],  # one sequence, greedy
                   [step(f"s{i}", m, 3) for i in range(4)],  # several, greedy, m = 3
                   [step(f"s{i}", m, 2, temperature=1.0, seed=i, return_logprobs=True, top_k_probs=4)
                    for i in range(4)]]
        if pd.supported:  # pre-drafting steps of one sequence, then of four: each pass, a hit, the pass after it
            batches += [[step("s0", m + 2, 1, predraft_branches=8)],
                        [step(f"s{i}", m + 2, 1, predraft_branches=8) for i in range(4)]]
            if long > m + 8:  # the same over long contexts, where attention splits the context (other kernels)
                batches += [[step(f"l{i}", 0, long) for i in range(4)],
                            [step("l0", long, 1, predraft_branches=8)],
                            [step(f"l{i}", long, 1, predraft_branches=8) for i in range(4)]]
        for batch in batches:
            bad = [o for o in proposer.step(batch) if o.code]
            if bad:
                log.warning("warm-up step refused (%s): the first real steps may compile kernels", bad[0].message)
                break
            if pd.has_work():
                try:
                    pd.prepare(lambda: False)  # (the pass after a plain step: its forced pass runs one row)
                    hits = hits_of(batch)
                    if hits and all(o.predrafted for o in proposer.step(hits)) and pd.has_work():
                        pd.prepare(lambda: False)  # (the pass after a hit: its forced pass runs the hit's rows too)
                except Exception:  # (as the scheduler does with a pass that raises: plain drafting goes on)
                    log.exception("warm-up pre-drafting pass failed: the first real passes may compile kernels")
                    pd.reset()
                    break
        if proposer.device.type == "cuda":
            torch.cuda.synchronize()
    finally:
        for i in range(4):
            proposer.table.release(ns, f"s{i}")
            proposer.table.release(ns, f"l{i}")
        # the pool as at start (zeros, free list in order): what the warm-up wrote, its passes' scratch branches
        # included, is gone, and its allocations (which depend on the outcomes its passes prepared) do not order
        # later ones, so that two drafters given the same steps hold the same KV (tests/test_cuda_fast_path.py)
        proposer.kv.kv.zero_()
        if proposer.kv.pool.num_free == proposer.kv.num_blocks:
            proposer.kv.pool.reset()
        proposer.metrics = metrics
        passes, hits = pd.counters.passes, pd.counters.hits
        pd.counters = counters
        pd.odds.min_all_hit = min_all_hit
        pd.forget_estimates()  # (the warm-up's passes compiled kernels: their times say nothing)
        if proposer.decode_graphs is not None:  # (their counters tell how many real steps the graphs served)
            proposer.decode_graphs.steps_run = proposer.decode_graphs.first_steps_run = 0
    log.info("warm-up steps ran in %.1f s (%d kernel variants, %d pre-drafting passes, %d hits)",
             time.perf_counter() - t0, variants, passes, hits)


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_HEAP_BLOCK_BYTES = 1 << 30  # blocks up to this size come from (and go back to) the heap


def keep_large_blocks_in_heap() -> bool:
    """Have glibc serve blocks up to 1 GiB from the heap and keep freed memory there, instead of an mmap per large
    block (its default from 32 MiB up, and trimming the heap's top past 128 KiB). Each large message (gRPC's
    receive buffers, protobuf's bytes, staging tensors) otherwise lands on fresh pages that the kernel faults in
    and zeroes one by one: for a 32 MiB message that was most of the server's time (docs/performance.md, "Large
    steps over TCP"). The cost: the process keeps its peak heap instead of returning it to the kernel. Returns
    False where the C library has no mallopt (not glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _HEAP_BLOCK_BYTES) and mallopt(_M_TRIM_THRESHOLD, _HEAP_BLOCK_BYTES))


def build_runtime(cfg: ServerConfig) -> Runtime:
    """The drafter's model, KV cache, proposer and limits (the server's, or an engine's own in-process drafter).
    With cfg.tune_malloc (the default) it also tunes the process's malloc (keep_large_blocks_in_heap): an in-process
    step at batch 128 on the dev CPU took 17-18 ms, or 28 ms in about a third of the runs with glibc's defaults
    (large temporaries on fresh pages faulted in again), and 16.5-18.3 ms in every run tuned."""
    if cfg.tune_malloc and not keep_large_blocks_in_heap():
        log.info("malloc left as it is (no glibc mallopt here)")
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    # (process-wide: the step thread's ops use torch's intra-op pool.) On CUDA the host side of a step is small
    # tensors (step metadata, block tables): one thread, unless asked, since a CPU op that wakes a pool of one thread
    # per core costs milliseconds in a VM (torch.repeat_interleave took 1-2 ms per call with 16 on an H100 VM).
    if cfg.cpu_threads or device.type == "cuda":
        torch.set_num_threads(cfg.cpu_threads or 1)
    import json
    import pathlib

    head_cfg_path = pathlib.Path(cfg.model) / "config.json"
    head_max_pos = 2048
    if head_cfg_path.is_file():
        head_max_pos = int(json.loads(head_cfg_path.read_text()).get("max_position_embeddings", 2048))
    max_model_len = cfg.max_model_len or head_max_pos
    loaded = load_head(cfg.model, cfg.target_model, device, dtype, max_positions=max_model_len,
                       engine_applies_fc=cfg.engine_applies_fc)
    model = loaded.model
    d = model.dims
    per_token = KVCache.bytes_per_token(model.num_kv_layers, d.num_kv_heads, d.head_dim, dtype)
    tokens = _kv_tokens(cfg, device, per_token)
    num_blocks = tokens // cfg.block_size
    if num_blocks * cfg.block_size < max_model_len:
        raise ValueError(f"the KV pool holds {num_blocks * cfg.block_size} tokens, fewer than one sequence of "
                         f"max_model_len {max_model_len}: raise --kv-cache-tokens / --gpu-memory-fraction or lower "
                         "--max-model-len")
    kv = KVCache(model.num_kv_layers, num_blocks, cfg.block_size, d.num_kv_heads, d.head_dim, dtype, device)
    metrics = Metrics(kv_blocks_free=num_blocks, kv_blocks_total=num_blocks)
    metrics.set_build_info(__version__, model.method, str(device), str(dtype).removeprefix("torch."))
    proposer = Proposer(model, kv, max_model_len, device, metrics, SequenceLimits(
        lease_s=cfg.sequence_lease_s, max_sequences=cfg.max_sequences,
        max_sequences_per_namespace=cfg.max_sequences_per_namespace,
        namespace_pool_share=cfg.namespace_pool_share))
    proposer.predraft.cycle_check = cfg.predraft_cycle_check
    if not 0.0 <= cfg.predraft_min_all_hit <= 1.0:
        raise ValueError(f"--predraft-min-all-hit must be in [0, 1], got {cfg.predraft_min_all_hit}")
    proposer.predraft.odds.min_all_hit = cfg.predraft_min_all_hit
    share = proposer.table.namespace_block_limit
    if share is not None and share * cfg.block_size < max_model_len:
        log.warning("--namespace-pool-share %g gives a namespace %d tokens of KV, fewer than one sequence of "
                    "max_model_len %d", cfg.namespace_pool_share, share * cfg.block_size, max_model_len)
    max_batch_tokens = cfg.max_batch_tokens or max(8192, max_model_len)
    if device.type == "cuda" and cfg.cuda_graphs:  # after the KV pool exists: the graphs hold its address
        proposer.decode_graphs = capture_decode_graphs(proposer, cfg.block_size, max_model_len, cfg.max_batch_seqs,
                                                       dtype, device, cfg.first_step_graph_tokens,
                                                       cfg.max_draft_tokens,
                                                       min(cfg.first_step_graph_rows, max_batch_tokens),
                                                       max_top_k_probs(model) if cfg.sampled_step_graphs else None)
    max_draft_tokens = cfg.max_draft_tokens
    if model.drafting == "multi_layer":  # one draft per layer
        max_draft_tokens = min(max_draft_tokens, model.num_predict)
    if device.type == "cuda":
        warm_up(proposer, model.hidden_states_width, max_draft_tokens)
    limits = Limits(hidden_states_width=model.hidden_states_width, vocab_size=model.vocab_size,
                    max_draft_tokens=max_draft_tokens, max_request_tokens=max_batch_tokens,
                    max_request_seqs=cfg.max_batch_seqs,
                    max_top_k_probs=max_top_k_probs(model),
                    max_predraft_branches=MAX_PREDRAFT_BRANCHES if proposer.predraft.supported else 0,
                    width_note=("; this drafter runs with --engine-applies-fc: send the head's fc applied to the "
                                "three layers' states, drafter_client.EngineFc" if cfg.engine_applies_fc else ""))
    log.info("drafter %s: %s head %s (%s drafting) on %s (%s), vocab %d (draft %d), hidden %d, KV pool %d tokens "
             "(%.1f MiB), max_model_len %d", __version__, model.method, loaded.name, model.drafting, device,
             str(dtype).removeprefix("torch."), model.vocab_size, model.draft_vocab_size, d.hidden_size,
             num_blocks * cfg.block_size, num_blocks * cfg.block_size * per_token / 2**20, max_model_len)
    if loaded.target_layer_ids:
        log.info("the engine sends %s", loaded.hidden_states_source)
    return Runtime(config=cfg, device=device, dtype=dtype, model_name=loaded.name, model=model, kv=kv,
                   proposer=proposer, limits=limits, max_model_len=max_model_len, metrics=metrics,
                   hidden_states_source=loaded.hidden_states_source, target_layer_ids=loaded.target_layer_ids)
