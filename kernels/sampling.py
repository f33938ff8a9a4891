"""Draft-token selection over the vocabulary.

* ``argmax``: greedy, ties -> lowest id (like torch.argmax).
* ``gumbel_sample``: exact sampling from ``softmax(logits / temperature)`` by the Gumbel-max trick,
  ``argmax_v(logits[v] / T + g[v])`` with ``g = -log(-log(u))``, u uniform in (0, 1). Temperature 0 means argmax.

The uniforms are a pure function of ``(seed, position, vocab id)``: one Philox-4x32-10 block with key = seed
(lo, hi 32 bits) and counter = (vocab id, 0, position lo, position hi); the first output word ``r`` gives
``u = (r + 0.5) / 2**32``. A replayed step (same seed and position) therefore draws the same token, and the torch
reference below computes bit-identical uniforms. Scores are compared in fp64 so the reference and the kernel pick
the same token (they could only differ on fp64 near-ties, which need ulp-equal scores).
Optionally both return ``log_softmax(logits / T)`` at the chosen id (T = 1 for greedy rows), computed in fp32.
"""

import torch

from drafter_kernels._triton_shim import DEFAULT_SM_COUNT, device_sm_count, tl, triton

PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
PHILOX_ROUNDS = 10
_MASK32 = 0xFFFFFFFF


def argmax_ref(
    logits: torch.Tensor,  # [B, V]
    *,
    out: torch.Tensor | None = None,  # [B] int64
) -> torch.Tensor:  # [B] int64
    token_ids = logits.argmax(dim=-1)
    return token_ids if out is None else out.copy_(token_ids)


def _mul_hi_lo_32(constant: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of ``constant * x`` for x in [0, 2**32), exactly, in int64 (16-bit limbs, no overflow)."""
    c_hi, c_lo = constant >> 16, constant & 0xFFFF
    x_hi, x_lo = x >> 16, x & 0xFFFF
    low_product = c_lo * x_lo
    middle = c_hi * x_lo + c_lo * x_hi + (low_product >> 16)  # < 2**34
    high = c_hi * x_hi + (middle >> 16)
    low = ((middle & 0xFFFF) << 16) | (low_product & 0xFFFF)
    return high, low


def philox_uniform_ref(
    seed: torch.Tensor,  # [R] int64
    position: torch.Tensor,  # [R] int64
    vocab_size: int,
) -> torch.Tensor:  # [R, V] fp64 uniforms in (0, 1); the Triton kernel draws the same values
    c0 = torch.arange(vocab_size, dtype=torch.int64, device=seed.device).expand(seed.shape[0], vocab_size)
    c1 = torch.zeros_like(c0)
    c2 = (position.long() & _MASK32)[:, None].expand_as(c0)
    c3 = ((position.long() >> 32) & _MASK32)[:, None].expand_as(c0)
    k0, k1 = (seed.long() & _MASK32)[:, None], ((seed.long() >> 32) & _MASK32)[:, None]
    for _ in range(PHILOX_ROUNDS):
        hi_a, lo_a = _mul_hi_lo_32(PHILOX_ROUND_A, c0)
        hi_b, lo_b = _mul_hi_lo_32(PHILOX_ROUND_B, c2)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + PHILOX_KEY_A) & _MASK32, (k1 + PHILOX_KEY_B) & _MASK32
    return (c0.double() + 0.5) * 2.0**-32


def gumbel_sample_ref(
    logits: torch.Tensor,  # [B, V]
    temperature: torch.Tensor,  # [B] fp32, 0 = greedy
    seed: torch.Tensor,  # [B] int64
    position: torch.Tensor,  # [B] int64
    *,
    return_logprobs: bool = False,
    out: torch.Tensor | None = None,  # [B] int64
    out_logprobs: torch.Tensor | None = None,  # [B] fp32
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # token ids [B] int64 (, logprobs [B] fp32)
    num_rows, vocab_size = logits.shape
    is_greedy = temperature == 0
    effective_temperature = torch.where(is_greedy, 1.0, temperature.float())
    token_ids = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    rows_per_chunk = max(1, 2**20 // max(vocab_size, 1))  # bounds the [rows, V] int64 Philox temporaries
    for start in range(0, num_rows, rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        uniform = philox_uniform_ref(seed[rows], position[rows], vocab_size)
        scores = logits[rows].double() / effective_temperature[rows, None].double() - torch.log(-torch.log(uniform))
        token_ids[rows] = torch.where(is_greedy[rows], logits[rows].argmax(dim=-1), scores.argmax(dim=-1))
    token_ids = token_ids if out is None else out.copy_(token_ids)
    if not return_logprobs:
        return token_ids
    logprobs = torch.log_softmax(logits.float() / effective_temperature[:, None], dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    return token_ids, (chosen if out_logprobs is None else out_logprobs.copy_(chosen))


# ----------------------------------------------------------------------------------------------------------------
# Triton
#
# Inputs:  logits [B, V] (unit stride on V); temperature [B] fp32; seed, position [B] int64.
# Writes:  out [B] int64 (and out_logprobs [B] fp32 when asked), every row.
# Two-stage reduction. Stage 1, grid (B, num_chunks): one program walks chunk c = ids [c * chunk_size,
# (c + 1) * chunk_size) of one row in BLOCK_V tiles keeping the best (score, id) so far; a later tile replaces it
# only with a strictly larger score, so ties keep the lowest id. It writes the chunk's best (and, for logprobs, the
# chunk's scaled logit at that id and its running (max, sum of exp)) to scratch [B, num_chunks]. Stage 2, grid (B,):
# the row's maximum over chunks, the lowest id among the chunks that reach it (ids are disjoint and ordered by
# chunk), and the logsumexp merged over chunks. With one chunk, stage 1 writes the outputs itself.
# The chunking is chosen on the host from (B, V) only, so a launch never reads device values.
# ----------------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["num_chunks"])
def _argmax_kernel(logits_ptr, logits_stride, out_ptr, part_value_ptr, part_id_ptr, vocab_size, chunk_size,
                   num_chunks, BLOCK_V: tl.constexpr, SINGLE_CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    chunk_start = chunk * chunk_size
    chunk_end = tl.minimum(chunk_start + chunk_size, vocab_size)
    best_value = tl.full([], float("-inf"), tl.float32)
    best_id = chunk_start  # an all -inf chunk: its first id, as torch.argmax picks id 0 of an all -inf row
    for tile_start in range(chunk_start, chunk_end, BLOCK_V):
        ids = tile_start + tl.arange(0, BLOCK_V)
        in_chunk = ids < chunk_end
        values = tl.load(logits_ptr + row * logits_stride + ids, mask=in_chunk, other=float("-inf"))
        values = values.to(tl.float32)
        tile_max = tl.max(values, 0)
        tile_id = tl.min(tl.where((values == tile_max) & in_chunk, ids, vocab_size), 0)
        is_better = tile_max > best_value
        best_id = tl.where(is_better, tile_id, best_id)
        best_value = tl.where(is_better, tile_max, best_value)
    if SINGLE_CHUNK:
        tl.store(out_ptr + row, best_id.to(tl.int64))
    else:
        tl.store(part_value_ptr + row * num_chunks + chunk, best_value)
        tl.store(part_id_ptr + row * num_chunks + chunk, best_id)


@triton.jit(do_not_specialize=["num_chunks"])
def _argmax_reduce_kernel(part_value_ptr, part_id_ptr, out_ptr, num_chunks, vocab_size, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, BLOCK_C)
    mask = chunks < num_chunks
    values = tl.load(part_value_ptr + row * num_chunks + chunks, mask=mask, other=float("-inf"))
    ids = tl.load(part_id_ptr + row * num_chunks + chunks, mask=mask, other=0)
    best_value = tl.max(values, 0)
    best_id = tl.min(tl.where((values == best_value) & mask, ids, vocab_size), 0)
    tl.store(out_ptr + row, best_id.to(tl.int64))


@triton.jit
def _philox_first_word(c0, c1, c2, c3, k0, k1):
    # Philox-4x32-10 on uint32 tensors; returns the first output word. Mirrors philox_uniform_ref.
    for _ in tl.static_range(10):
        hi_a = tl.umulhi(c0, 0xD2511F53)
        lo_a = c0 * 0xD2511F53
        hi_b = tl.umulhi(c2, 0xCD9E8D57)
        lo_b = c2 * 0xCD9E8D57
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0


@triton.jit(do_not_specialize=["num_chunks"])
def _gumbel_sample_kernel(
    logits_ptr, logits_stride, temperature_ptr, seed_ptr, position_ptr, out_ptr, out_logprobs_ptr,
    part_score_ptr, part_id_ptr, part_scaled_ptr, part_max_ptr, part_sum_ptr,
    vocab_size, chunk_size, num_chunks,
    WRITE_LOGPROBS: tl.constexpr, BLOCK_V: tl.constexpr, SINGLE_CHUNK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    chunk_start = chunk * chunk_size
    chunk_end = tl.minimum(chunk_start + chunk_size, vocab_size)
    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    is_greedy = temperature == 0.0
    safe_temperature = tl.where(is_greedy, 1.0, temperature)
    seed = tl.load(seed_ptr + row).to(tl.int64)
    position = tl.load(position_ptr + row).to(tl.int64)
    key_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    key_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    position_lo = (position & 0xFFFFFFFF).to(tl.uint32)
    position_hi = ((position >> 32) & 0xFFFFFFFF).to(tl.uint32)

    best_score = tl.full([], float("-inf"), tl.float64)
    best_id = chunk_start
    best_scaled_logit = tl.zeros([], tl.float32)  # logits[best_id] / T, for the logprob
    running_max = tl.full([], float("-inf"), tl.float32)  # of logits / T
    running_sum = tl.zeros([], tl.float32)  # of exp(logits / T - running_max)
    for tile_start in range(chunk_start, chunk_end, BLOCK_V):
        ids = tile_start + tl.arange(0, BLOCK_V)
        in_chunk = ids < chunk_end
        logits = tl.load(logits_ptr + row * logits_stride + ids, mask=in_chunk, other=float("-inf")).to(tl.float32)

        counter_lo = ids.to(tl.uint32)
        random_word = _philox_first_word(counter_lo, tl.zeros_like(counter_lo), position_lo + tl.zeros_like(counter_lo),
                                         position_hi + tl.zeros_like(counter_lo), key_lo, key_hi)
        uniform = (random_word.to(tl.float64) + 0.5) * 2.3283064365386963e-10  # 2**-32
        gumbel = -tl.log(-tl.log(uniform))
        sampled_score = logits.to(tl.float64) / safe_temperature.to(tl.float64) + gumbel
        score = tl.where(is_greedy, logits.to(tl.float64), sampled_score)
        score = tl.where(in_chunk, score, float("-inf"))

        tile_max = tl.max(score, 0)
        tile_id = tl.min(tl.where((score == tile_max) & in_chunk, ids, vocab_size), 0)
        is_better = tile_max > best_score
        best_id = tl.where(is_better, tile_id, best_id)
        best_score = tl.where(is_better, tile_max, best_score)
        if WRITE_LOGPROBS:
            scaled = logits / safe_temperature
            tile_scaled_at_id = tl.sum(tl.where(ids == tile_id, scaled, 0.0), 0)
            best_scaled_logit = tl.where(is_better, tile_scaled_at_id, best_scaled_logit)
            new_max = tl.maximum(running_max, tl.max(scaled, 0))
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            running_sum = running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(scaled - shift), 0)
            running_max = new_max

    if SINGLE_CHUNK:
        tl.store(out_ptr + row, best_id.to(tl.int64))
        if WRITE_LOGPROBS:
            tl.store(out_logprobs_ptr + row, best_scaled_logit - running_max - tl.log(running_sum))
    else:
        part = row * num_chunks + chunk
        tl.store(part_score_ptr + part, best_score)
        tl.store(part_id_ptr + part, best_id)
        if WRITE_LOGPROBS:
            tl.store(part_scaled_ptr + part, best_scaled_logit)
            tl.store(part_max_ptr + part, running_max)
            tl.store(part_sum_ptr + part, running_sum)


@triton.jit(do_not_specialize=["num_chunks"])
def _gumbel_sample_reduce_kernel(
    part_score_ptr, part_id_ptr, part_scaled_ptr, part_max_ptr, part_sum_ptr, out_ptr, out_logprobs_ptr,
    num_chunks, vocab_size,
    WRITE_LOGPROBS: tl.constexpr, BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, BLOCK_C)
    mask = chunks < num_chunks
    part = row * num_chunks + chunks
    scores = tl.load(part_score_ptr + part, mask=mask, other=float("-inf"))
    ids = tl.load(part_id_ptr + part, mask=mask, other=0)
    best_score = tl.max(scores, 0)
    best_id = tl.min(tl.where((scores == best_score) & mask, ids, vocab_size), 0)
    tl.store(out_ptr + row, best_id.to(tl.int64))
    if WRITE_LOGPROBS:
        scaled = tl.load(part_scaled_ptr + part, mask=mask, other=0.0)
        best_scaled_logit = tl.sum(tl.where((ids == best_id) & mask, scaled, 0.0), 0)
        chunk_max = tl.load(part_max_ptr + part, mask=mask, other=float("-inf"))
        chunk_sum = tl.load(part_sum_ptr + part, mask=mask, other=0.0)
        global_max = tl.max(chunk_max, 0)
        shift = tl.where(global_max == float("-inf"), 0.0, global_max)
        total = tl.sum(chunk_sum * tl.exp(chunk_max - shift), 0)
        tl.store(out_logprobs_ptr + row, best_scaled_logit - global_max - tl.log(total))


MAX_CHUNKS = 1024


def vocab_launch_config(num_rows: int, vocab_size: int, sm_count: int = DEFAULT_SM_COUNT) -> tuple[int, int]:
    """(BLOCK_V, chunk_size) from host-known shapes: about 4 programs per SM, chunks a multiple of BLOCK_V."""
    block_v = min(1024, triton.next_power_of_2(max(vocab_size, 1)))
    num_tiles = triton.cdiv(vocab_size, block_v)
    num_chunks = max(1, min(num_tiles, MAX_CHUNKS, triton.cdiv(4 * sm_count, max(num_rows, 1))))
    return block_v, triton.cdiv(num_tiles, num_chunks) * block_v


def _argmax_launch(logits: torch.Tensor, out: torch.Tensor, block_v: int, chunk_size: int) -> torch.Tensor:
    num_rows, vocab_size = logits.shape
    assert chunk_size % block_v == 0
    num_chunks = triton.cdiv(vocab_size, chunk_size)
    if num_chunks > 1:
        part_value = torch.empty(num_rows, num_chunks, dtype=torch.float32, device=logits.device)
        part_id = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=logits.device)
    else:
        part_value = part_id = out  # unused
    _argmax_kernel[(num_rows, num_chunks)](logits, logits.stride(0), out, part_value, part_id, vocab_size, chunk_size,
                                           num_chunks, BLOCK_V=block_v, SINGLE_CHUNK=num_chunks == 1)
    if num_chunks > 1:
        _argmax_reduce_kernel[(num_rows,)](part_value, part_id, out, num_chunks, vocab_size,
                                           BLOCK_C=triton.next_power_of_2(num_chunks))
    return out


def argmax_triton(
    logits: torch.Tensor,  # [B, V]
    *,
    out: torch.Tensor | None = None,  # [B] int64
) -> torch.Tensor:  # [B] int64
    num_rows, vocab_size = logits.shape
    assert logits.stride(1) == 1
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device) if out is None else out
    if num_rows > 0 and vocab_size > 0:
        _argmax_launch(logits, out, *vocab_launch_config(num_rows, vocab_size, device_sm_count(logits.device)))
    return out


def compile_argmax_variants(vocab_size: int, dtype: torch.dtype, device: torch.device) -> int:
    """Launch the argmax once per kernel variant a batch of any size can pick over this vocabulary (one chunk or
    several, and each power-of-two tile of the reduce over the chunks), on one throw-away row: the compile key does
    not depend on the row count, so the Triton JIT compiles them all now, not in the middle of a step. Logits as the
    heads give them ([rows, vocab_size] of dtype, rows contiguous). Returns the launches."""
    sm_count = device_sm_count(device)
    configs, seen = [], set()
    rows = 1
    while True:
        block_v, chunk_size = vocab_launch_config(rows, vocab_size, sm_count)
        num_chunks = triton.cdiv(vocab_size, chunk_size)
        key = triton.next_power_of_2(num_chunks) if num_chunks > 1 else 0
        if key not in seen:
            seen.add(key)
            configs.append((block_v, chunk_size))
        if num_chunks == 1:  # (more rows: fewer chunks; one chunk is the last variant)
            break
        rows += 1
    logits = torch.zeros(1, vocab_size, dtype=dtype, device=device)
    out = torch.empty(1, dtype=torch.int64, device=device)
    for block_v, chunk_size in configs:
        _argmax_launch(logits, out, block_v, chunk_size)
    return len(configs)


def _gumbel_sample_launch(logits, temperature, seed, position, return_logprobs, out, out_logprobs,
                          block_v: int, chunk_size: int) -> None:
    num_rows, vocab_size = logits.shape
    assert chunk_size % block_v == 0
    num_chunks = triton.cdiv(vocab_size, chunk_size)
    out_logprobs = out_logprobs if return_logprobs else out  # unused without logprobs
    if num_chunks > 1:
        dev = dict(device=logits.device)
        part_score = torch.empty(num_rows, num_chunks, dtype=torch.float64, **dev)
        part_id = torch.empty(num_rows, num_chunks, dtype=torch.int32, **dev)
        if return_logprobs:
            part_scaled, part_max, part_sum = torch.empty(3, num_rows, num_chunks, dtype=torch.float32, **dev)
        else:
            part_scaled = part_max = part_sum = part_score  # unused
    else:
        part_score = part_id = part_scaled = part_max = part_sum = out  # unused
    _gumbel_sample_kernel[(num_rows, num_chunks)](
        logits, logits.stride(0), temperature, seed, position, out, out_logprobs,
        part_score, part_id, part_scaled, part_max, part_sum,
        vocab_size, chunk_size, num_chunks,
        WRITE_LOGPROBS=return_logprobs, BLOCK_V=block_v, SINGLE_CHUNK=num_chunks == 1,
    )
    if num_chunks > 1:
        _gumbel_sample_reduce_kernel[(num_rows,)](
            part_score, part_id, part_scaled, part_max, part_sum, out, out_logprobs,
            num_chunks, vocab_size,
            WRITE_LOGPROBS=return_logprobs, BLOCK_C=triton.next_power_of_2(num_chunks),
        )


def gumbel_sample_triton(
    logits: torch.Tensor,  # [B, V]
    temperature: torch.Tensor,  # [B] fp32, 0 = greedy
    seed: torch.Tensor,  # [B] int64
    position: torch.Tensor,  # [B] int64
    *,
    return_logprobs: bool = False,
    out: torch.Tensor | None = None,  # [B] int64
    out_logprobs: torch.Tensor | None = None,  # [B] fp32
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    num_rows, vocab_size = logits.shape
    assert logits.stride(1) == 1 and temperature.shape == seed.shape == position.shape == (num_rows,)
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device) if out is None else out
    if return_logprobs and out_logprobs is None:
        out_logprobs = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    if num_rows > 0 and vocab_size > 0:
        _gumbel_sample_launch(logits, temperature, seed, position, return_logprobs, out, out_logprobs,
                              *vocab_launch_config(num_rows, vocab_size, device_sm_count(logits.device)))
    return (out, out_logprobs) if return_logprobs else out
