"""Launch configurations (block shapes, warps, pipeline stages) for the attention kernels.

Three regimes:

* Triton's interpreter (CPU): fixed tiles. Its cost is per program and loop iteration, not per element,
  so sequences of 256 and more take large tiles (10x faster than small ones at 256 tokens); shorter ones
  take small tiles with ``BLOCK_M != BLOCK_N``, so the CPU tests cross several blocks on both axes and
  exercise the causal stage split with unequal tiles, as the GPU does.
* float64 on the GPU: one small fixed tile (fp64 tiles are 4x the bytes of bf16 ones; fp64 exists for
  gradcheck and exactness checks, not speed).
* float16 / bfloat16 / float32 on the GPU: a short list of candidates per kernel, picked by
  ``triton.autotune`` once per (head_dim, causal, dtypes, sequence-length bucket, grid size in waves).
"""

from __future__ import annotations

import contextlib
import csv
import functools

import torch
import triton

from .launch import INTERPRET, launch_kernel


# Host-side integer helpers for the launch paths. triton.cdiv and triton.next_power_of_2 are constexpr
# functions in triton 3.6, whose Python wrapper costs ~5 us a call on the CPU box (0.1 us for these), and a
# forward + backward makes nine such calls (benchmarks/NOTES.md: host time per call).
def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive b."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def block_d(head_dim: int) -> int:
    """Head dim padded to a power of two, at least 16 (the smallest ``tl.dot`` operand)."""
    return max(16, next_power_of_2(head_dim))


def fp8_block_d(head_dim: int) -> int:
    """Head dim of the FP8 kernels' tiles: as ``block_d``, but at least 32, because Hopper's FP8 MMA (wgmma
    with e4m3 operands) reduces over 32 elements at a time and Triton refuses a smaller FP8 ``tl.dot``."""
    return max(32, block_d(head_dim))


# Elements of one program of the row-wise one-pass kernels (dequantisation, centring): fp32 in registers at 4
# warps, as fp8_quant.QUANT_CHUNK_ELEMENTS.
ROW_PASS_ELEMENTS = 8192


def row_pass_rows(seq: int, block_d: int) -> int:
    """Rows a program of a row-wise one-pass kernel takes: ROW_PASS_ELEMENTS of a (seq, block_d) tensor, at most
    seq rounded up to a power of two."""
    return min(next_power_of_2(seq), max(1, ROW_PASS_ELEMENTS // block_d))


def seq_bucket(seq_len: int) -> int:
    """Autotune key for a sequence length: its power-of-two bucket, capped so long sequences share one."""
    return min(next_power_of_2(max(seq_len, 1)), 16384)


# Rows a program, for ``wave_bucket``'s count of a launch's programs, whatever tile the tuner then picks
WAVE_BUCKET_ROWS = 128


def wave_bucket(pairs: int, rows: int, device: torch.device) -> int:
    """Autotune key for a launch's size: its programs (``pairs`` (batch, head) pairs of ``rows`` rows each, at
    WAVE_BUCKET_ROWS rows a program) in waves over the device's SMs, rounded up to a power of two and capped at 8
    (1 for CPU tensors). The fastest tile differs between a grid that leaves SMs idle and one that fills the GPU
    many times over, and Triton's disk cache of picks is shared by every process. Keyed by the sequence bucket
    alone, a bf16 (1, 2, 4096, 256) causal launch tuned first handed its picks to a later process's (4, 8, 4096,
    256): its forward and backward ran 20% slower than with its own picks (benchmarks/NOTES.md, thirty-ninth
    session)."""
    if device.type != "cuda":
        return 1
    return min(next_power_of_2(cdiv(pairs * cdiv(rows, WAVE_BUCKET_ROWS), sm_count(device))), 8)


def launch_device(t: torch.Tensor):
    """A context in which kernels launch on ``t``'s GPU. Triton launches on the current CUDA device, whatever
    device the tensors are on: with cuda:0 current and tensors on cuda:1, the Hopper kernels' launches raise
    ("Pointer argument ... cannot be accessed from Triton", seen on a 2-GPU H200 host) and others may run on
    cuda:0, on its stream, out of order with cuda:1's work. A no-op for CPU tensors and when that device is
    already current, as it is in Lightning's processes."""
    return torch.cuda.device(t.device) if _on_another_gpu(t) else contextlib.nullcontext()


def _on_another_gpu(t: torch.Tensor) -> bool:
    """Whether ``t`` is on a CUDA device other than the current one."""
    return t.is_cuda and t.device.index != torch.cuda.current_device()


def device_capability(device: torch.device) -> tuple[int, int]:
    """``torch.cuda.get_device_capability(device)``, asked once per device in eager calls: the query costs a few
    microseconds of host time, and the FP8 op asked it three times a call. Under torch.compile it is asked directly:
    Dynamo folds it into a constant, and it warns about a ``functools.cache`` wrapper it traces through."""
    if torch.compiler.is_compiling():
        return torch.cuda.get_device_capability(device)
    return _cached_capability(device)


@functools.cache
def _cached_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.cache
def sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors, asked once per device (as ``device_capability``)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def on_input_device(launcher):
    """Decorator for a launcher: run it in ``launch_device`` of its first tensor argument."""
    @functools.wraps(launcher)
    def launch_on_input_device(*args, **kwargs):
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is None or not _on_another_gpu(first):  # no context (an FP8 forward passes here six times)
            return launcher(*args, **kwargs)
        with torch.cuda.device(first.device):
            return launcher(*args, **kwargs)
    return launch_on_input_device


# Causal kernels launch their blocks heaviest first within sections of (batch, head) pairs (the forwards' and
# dQ's query blocks: ``attention_fwd._query_block_coords``; dK/dV's key blocks: ``_key_block_coords``);
# ``causal_sections`` sizes them. A section needs at least one block per SM, so that its lighter blocks fill in
# behind its heavy ones (a last section smaller than that ends the grid on heavy blocks: the sections are as even
# as can be), and may grow while the rows it streams (the forwards' and dQ's K and V, dK/dV's Q and dO) fit
# CAUSAL_SECTION_KV_BYTES, so that the blocks running together share them in L2 (50 MB on an H100, 60 on an H200);
# rounded up to a power of two, which divides the usual head and batch counts. Measured on the H200
# (benchmarks/NOTES.md, thirty-third session; each kernel alone, causal, GPU time, sections of 1 pair (head by
# head) to all of them): the FP8 Hopper forward at head_dim 256 (4, 8, 4096) 432-451 us head by head, 346-351 in
# sections of 4-8 pairs, 372-376 in one; at 128 (4, 16, 4096) 408-424 -> 386-391 (8 pairs), 408-411 (one); (1, 8,
# 4096, 128) 79-88 -> 62-64. The 16-bit Hopper forward at 128: (4, 16, 4096) 541-573 head by head, 549-555 by 4-8
# pairs, 598-634 in one (its K and V twice the FP8 bytes); (1, 16, 16384) 1809-1827 by 1-2 pairs, 1897-1907 by 4;
# (2, 16, 8192) 1054-1070 -> 978-981 (4). The Triton forward at 256: (4, 8, 4096) 771-780 -> 710-720 (8), (1, 8,
# 4096) 271 -> 176-178 (8). Sections of 5 of 32 pairs (a last one of 2) left the FP8 op at (4, 8, 4096, 256) where
# head by head put it (536 against 538 us). By this rule, the ops' forwards (bf16, GPU time, head by head -> rule):
# FP8 at 256 (4, 8, 4096) 551 -> 497 us, (1, 8, 16384) 1364 -> 1348; at 128 (4, 16, 4096) 538 -> 516, (1, 16, 16384)
# 1408 -> 1370, (2, 16, 8192) 823 -> 794; 16-bit at 256 (4, 8, 4096) 790 -> 729, (1, 8, 4096) 270 -> 176; at 128
# (4, 16, 4096) 524-560 -> 534-570 (two rounds each: no change beyond their spread), (1, 16, 16384) 1957 -> 1901.
# The backwards (thirty-fourth session; the op's backward, do_bench medians of two rounds, head by head -> rule):
# bf16 at 128 (4, 16, 4096) 2.04-2.08 -> 2.02-2.03 ms, (2, 16, 8192) 3.73-3.76 -> 3.64-3.68, (1, 16, 16384) level;
# at 64 (8, 12, 4096) 1.50-1.56 -> 1.48-1.50; at 256 level; FP8 "full" at 128 (4, 16, 4096) 2.00 -> 1.90-1.91, at
# 256 (4, 8, 4096) 3.09-3.10 -> 3.01, at 16k level to -2%. Sections of 2 or 32 MiB instead of 8: no better overall
# (2 MiB: bf16 at 64 (4, 32, 4096) 5-7% slower; 32 MiB: 1-3% slower at 16k but for bf16 at 256, 0.6% faster).
CAUSAL_SECTION_KV_BYTES = 8 << 20
# The number of sections instead of the rule (tests; None: the rule)
CAUSAL_SECTIONS: int | None = None


def causal_sections(causal: bool, pairs: int, blocks: int, group: int, seq: int, bytes_per_row: int,
                    device: torch.device) -> int:
    """Launch sections of a causal kernel with ``pairs`` (batch, head) pairs of ``blocks`` programs each, whose
    programs stream ``seq`` rows of ``bytes_per_row`` bytes that ``group`` pairs share: sections of at least one
    program per SM, more pairs while the rows they stream fit CAUSAL_SECTION_KV_BYTES, a power of two; from 1 to
    pairs. The forward and dQ stream K and V (``seq`` = seq_k) of a KV head that its ``group`` query heads share;
    dK/dV streams Q, dO, LSE and delta (``seq`` = seq_q) of a KV head's whole group of query heads, one pair
    alone. Without a mask 1 (the kernels do not read it)."""
    if not causal:
        return 1
    if CAUSAL_SECTIONS is not None:
        return max(1, min(CAUSAL_SECTIONS, pairs))
    sms = sm_count(device) if device.type == "cuda" else 1
    balance = cdiv(sms, max(1, blocks))
    footprint = CAUSAL_SECTION_KV_BYTES * group // max(1, seq * bytes_per_row)
    per_section = 1 << (max(balance, footprint, 1) - 1).bit_length()
    return max(1, pairs // per_section)


# Fixed configs: (BLOCK_M, BLOCK_N, num_warps, num_stages).
INTERPRET_FWD = (32, 16, 4, 1)
INTERPRET_DKDV = (16, 32, 4, 1)
INTERPRET_DQ = (32, 16, 4, 1)
INTERPRET_LONG_FWD = (128, 64, 4, 1)
INTERPRET_LONG_DKDV = (64, 128, 4, 1)
INTERPRET_LONG_DQ = (128, 64, 4, 1)
INTERPRET_LONG_SEQ = 256
FP64 = (32, 32, 4, 1)
FP64_WIDE = (16, 16, 4, 1)  # head_dim > 128: 32 x 32 fp64 tiles need ~320 KB of shared memory (H200: 227)


def fixed_config(kernel: str, dtype_is_fp64: bool, block_d: int, seq_len: int) -> dict:
    """The fixed launch parameters for ``kernel`` ('fwd', 'dkdv', 'dq') in the interpreter or fp64;
    ``seq_len`` is the longer of seq_q and seq_k."""
    if INTERPRET:
        if seq_len >= INTERPRET_LONG_SEQ:
            table = {"fwd": INTERPRET_LONG_FWD, "dkdv": INTERPRET_LONG_DKDV, "dq": INTERPRET_LONG_DQ}
        else:
            table = {"fwd": INTERPRET_FWD, "dkdv": INTERPRET_DKDV, "dq": INTERPRET_DQ}
        block_m, block_n, warps, stages = table[kernel]
    else:
        assert dtype_is_fp64
        block_m, block_n, warps, stages = FP64 if block_d <= 128 else FP64_WIDE
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)


# FP8 forward (BLOCK_M, BLOCK_N, num_warps, num_stages) per padded head dim (up to 64, 128, 256): fixed, because
# the quantisation tiles must equal the kernel's tiles (one scale per tile it loads). The fastest of a sweep on
# the H200 (benchmarks/NOTES.md).
FP8_FWD = {64: (128, 64, 8, 2), 128: (128, 128, 8, 3), 256: (128, 128, 8, 2)}
# the interpreter's FP8 forward tiles are its FP8 backward's scale tiles (INTERPRET_FP8_BWD), as on the GPU at
# head_dim 128 and 256, so that fp8="full"'s backward reads the forward's FP8 Q and K on the CPU too
INTERPRET_FP8_FWD = (32, 32, 4, 1)
INTERPRET_LONG_FP8_FWD = (128, 128, 4, 1)


def fp8_config(seq_len: int, head_dim: int) -> dict:
    """Launch parameters of the FP8 forward for Q/K rows of ``head_dim``; ``seq_len`` (the longer of seq_q,
    seq_k) picks the interpreter's tiles as for the 16-bit kernels."""
    if INTERPRET:
        block_m, block_n, warps, stages = INTERPRET_LONG_FP8_FWD if seq_len >= INTERPRET_LONG_SEQ else INTERPRET_FP8_FWD
    else:
        block_m, block_n, warps, stages = FP8_FWD[max(64, block_d(head_dim))]
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)


# FP8 backward. Q and dO are quantised in tiles of SCALE_M rows, K and V in tiles of SCALE_N rows; each kernel's
# (BLOCK_M, BLOCK_N, num_warps, num_stages) divides them, so a tile the kernels load has one scale.
FP8_BWD_SCALE_TILES = (128, 128)
# Fixed, the fastest of a sweep of each kernel alone on the H200 (benchmarks/NOTES.md, thirteenth session): at
# head_dim 128 (64, 128, 8, 3) led dK/dV at 4k and 16k, causal or not; (64, 64, 4, 3) was within 2-5% of the best
# dQ tile at each point. head_dim 64 and 256 dK/dV: 3 stages since the fifteenth session (with dK settled, below:
# 0.92x the time of the 2-stage kernel before it at 64, 16k causal; 0.77-0.91x at 256, 4k and 16k;
# results/fp8_bwd_settled_h200_2026-11-30.csv).
FP8_BWD_DKDV = {64: (64, 64, 4, 3), 128: (64, 128, 8, 3), 256: (64, 64, 8, 3)}
FP8_BWD_DQ = {64: (64, 64, 4, 2), 128: (64, 64, 4, 3), 256: (64, 64, 8, 2)}
# Per head_dim: whether the dK/dV kernel waits for dK's wgmma within each step (``attention_fp8_bwd._settled``).
# Left in flight across the loop's back edge, ptxas serialises every wgmma of the kernel (warning C7515). Settled,
# each kernel alone on the H200 against the serialised one (same tiles): head_dim 256 0.88-0.89x the time
# without a causal mask, 1.03x causal; head_dim 64 1.00x; head_dim 128 1.03-1.07x (the two warpgroups of its
# 8 warps keep the tensor cores busy in turn either way), so 128 stays serialised.
FP8_BWD_SETTLE_DK = {64: True, 128: False, 256: True}
# The interpreter: tiles of 16 / 32 rows under scale tiles of 32, so the CPU tests cross several tiles per scale
# and several scales; from 256 tokens the GPU's tiles (fewer, larger programs: faster there).
INTERPRET_FP8_BWD = ((32, 32), (16, 32, 4, 1), (32, 16, 4, 1))
INTERPRET_LONG_FP8_BWD = ((128, 128), (64, 128, 4, 1), (128, 64, 4, 1))


def fp8_bwd_tiles(seq_len: int, qk_dim: int) -> dict:
    """The FP8 backward's tiling for Q/K rows of ``qk_dim`` (after the rotation's padding): SCALE_M, SCALE_N (rows
    per scale of Q and dO, of K and V) and the launch parameters of its two kernels, "dkdv" and "dq" (dicts of
    BLOCK_M, BLOCK_N, num_warps, num_stages; "dkdv" also SETTLE_DK); ``seq_len`` as in fp8_config."""
    settle = False  # the interpreter runs no inline asm
    if INTERPRET:
        scales, dkdv, dq = INTERPRET_LONG_FP8_BWD if seq_len >= INTERPRET_LONG_SEQ else INTERPRET_FP8_BWD
    else:
        width = max(64, block_d(qk_dim))
        scales, dkdv, dq = FP8_BWD_SCALE_TILES, FP8_BWD_DKDV[width], FP8_BWD_DQ[width]
        settle = FP8_BWD_SETTLE_DK[width]

    def launch(cfg):
        block_m, block_n, warps, stages = cfg
        return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)

    return dict(SCALE_M=scales[0], SCALE_N=scales[1], dkdv=dict(launch(dkdv), SETTLE_DK=settle), dq=launch(dq))


def _configs(candidates):
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
        for (m, n, w, s) in candidates
    ]


# Candidates (BLOCK_M, BLOCK_N, num_warps, num_stages), one list for head_dim <= 128 and one for wider heads
# (256), whose tiles hold 2x the bytes per row: the narrow lists spill registers there (dK/dV at D=256 ran at
# ~40% of SDPA flash with them; benchmarks/NOTES.md).
# Forward: query tile x key tile.
FWD_CANDIDATES = _configs([
    (128, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 128, 8, 2),
    (64, 64, 4, 2),
    (128, 128, 8, 3),  # 224 KB of shared memory at D=128 (sm_90 allows 227)
])
FWD_CANDIDATES_WIDE = _configs([
    (64, 64, 4, 2),
    (64, 32, 4, 2),
    (128, 32, 8, 2),
    (128, 64, 8, 1),
])
# dK/dV: key tile (BLOCK_N) outer and large, query tile streamed. It keeps K, V (input dtype) and dK, dV (fp32)
# of BLOCK_N rows resident: BLOCK_N * D * 12 bytes, 96 KB at BLOCK_N = 32, D = 256.
DKDV_CANDIDATES = _configs([
    (32, 128, 4, 3),
    (32, 128, 8, 3),
    (64, 128, 8, 2),
    (32, 64, 4, 2),
    (64, 64, 4, 3),  # head_dim 64 at 16k: 5-7% ahead of (32, 64, 4, 2) (benchmarks/NOTES.md)
])
DKDV_CANDIDATES_WIDE = _configs([
    (32, 32, 4, 2),
    (32, 32, 8, 2),
    (64, 32, 8, 2),
    (16, 64, 8, 2),
])
# dQ: query tile outer and large, key tile streamed; keeps Q, dO and dQ of BLOCK_M rows resident.
DQ_CANDIDATES = _configs([
    (128, 32, 4, 3),
    (128, 32, 8, 3),
    (128, 64, 8, 2),
    (64, 32, 4, 2),
    (128, 64, 8, 3),  # head_dim 64 at 16k: 1-4% ahead of (128, 64, 8, 2)
])
DQ_CANDIDATES_WIDE = _configs([
    (64, 32, 8, 2),
    (32, 32, 4, 2),
    (32, 64, 4, 2),
    (64, 16, 4, 2),
])
WIDE_HEAD_DIM = 128  # head_dim above this takes the _WIDE lists


@functools.cache  # every launch asks (host time): the candidate lists are fixed
def largest_tile(kernel: str, head_dim: int) -> int:
    """The most rows a tile of the tuned ``kernel`` may hold at ``head_dim``, over the candidates the tuner picks
    from: query rows (BLOCK_M) for 'fwd' and 'dq', keys (BLOCK_N) for 'dkdv'. The launchers count their causal
    sections in tiles of this size, since the tuned tile is not known before the launch (with a smaller one the
    sections would hold more programs than they need)."""
    key, narrow, wide = {"fwd": ("BLOCK_M", FWD_CANDIDATES, FWD_CANDIDATES_WIDE),
                         "dkdv": ("BLOCK_N", DKDV_CANDIDATES, DKDV_CANDIDATES_WIDE),
                         "dq": ("BLOCK_M", DQ_CANDIDATES, DQ_CANDIDATES_WIDE)}[kernel]
    return max(c.kwargs[key] for c in (wide if head_dim > WIDE_HEAD_DIM else narrow))

# The Hopper (sm_90) forward of attention_fwd_hopper.py, per head_dim: (BLOCK_N, STAGES, CONSUMERS, consumer
# warpgroup registers, loader registers, ping-pong when causal, ping-pong otherwise). Fixed, not tuned: picked on
# the H200 (benchmarks/NOTES.md, eighth session). Shared memory STAGES * 2 * BLOCK_N * D * 2 bytes of K/V plus
# CONSUMERS * 64 * D * 2 of Q: 224 KB at D = 128 (sm_90 allows 227); registers CONSUMERS * 128 threads *
# consumer registers, under the SM's 64K.
HOPPER_FWD_CONFIGS = {
    64: (128, 3, 3, 160, 32, True, True),
    128: (128, 3, 2, 232, 40, True, False),
}


def hopper_fwd_meta(head_dim: int, causal: bool) -> dict:
    """The Hopper forward kernel's tile constexprs for ``head_dim`` (a key of HOPPER_FWD_CONFIGS): what its
    launcher passes and what scripts/compile_kernels.py compiles."""
    block_n, stages, consumers, consumer_regs, loader_regs, pp_causal, pp_full = HOPPER_FWD_CONFIGS[head_dim]
    return dict(BLOCK_N=block_n, STAGES=stages, CONSUMERS=consumers, PINGPONG=pp_causal if causal else pp_full,
                CONSUMER_REGS=consumer_regs, LOADER_REGS=loader_regs)

# The FP8 Hopper forward of attention_fp8_fwd_hopper.py, per head_dim (Q / K rows after the rotation's padding,
# equal to V's) and causal: (BLOCK_N, STAGES, softmax warpgroups, their registers, loader registers, ping-pong,
# scores summed in float16, output rescale skipped where its factors are 1). BLOCK_N divides the K/V quantisation
# tile (FP8_FWD's BLOCK_N); each warpgroup's 64 rows lie in one 128-row Q scale tile. Shared memory STAGES * 2 *
# BLOCK_N * D bytes of K and V^T plus 64 * D per warpgroup of Q: 120 KB at D = 128, 160 KB at 256. Registers:
# warpgroups * 128 threads * theirs plus 32 * the loader's, within the SM's 64K. Fixed, not swept.
# - Scores in float16 (F16_SCORES, head_dim 128 only, the same for both masks: Q and K are quantised to
#   FP8_SCORES_AMAX, so that |Q8 K8^T| <= 128 * 16 * 16 = 32768 fits float16): measured on the H200
#   (benchmarks/NOTES.md, twentieth session; kernel alone, (4, 16, 4096, 128) / (1, 16, 16384, 128), TFLOP/s)
#   757-759 -> 783-803 at 4k, 620-626 -> 657-661 causal, 825-829 -> 887-891 at 16k, 804-810 -> 846-857 causal.
#   At 256 the bound would be 65536.
# - Three warpgroups at head_dim 128, without ping-pong (twenty-ninth session; kernel alone, same shapes, two
#   rounds, TFLOP/s, against two warpgroups with ping-pong at 232 registers): 759-781 -> 835-836 at 4k (168
#   registers; 803-810 at 160), 630-631 -> 633-636 causal (160; 621 at 168), 871 -> 912-931 at 16k (168),
#   844-845 -> 864-866 causal (160; 826-835 at 168). With ping-pong: 796-800, 608-609, 882, 819-827 (160). ptxas
#   spills 92 bytes (168, no mask) and 40 (160, causal), none in the unmasked float16 loop (with the skipping of a
#   warpgroup's unseen key blocks, thirtieth session; 76 and 88 before).
# - The output's rescale skipped by each warp whose rows all have factor 1 (SKIP_UNIT_RESCALE, bit-identical
#   outputs), at head_dim 256 only: kernel alone on the H200 (benchmarks/NOTES.md, forty-third session; (4, 8, 4096)
#   and (1, 8, 16384), medians of three rounds, us) 631 -> 621 at 4k, 349 -> 347 causal, 2285 -> 2234 at 16k, 1178
#   -> 1164 causal; at head_dim 128 ((4, 16, 4096), (1, 16, 16384)) 670 -> 670, 387 -> 400 causal, 2355 -> 2339,
#   1235 -> 1272 causal: its 64 multiplies a step are not what bounds that kernel.
FP8_HOPPER_FWD_CONFIGS = {
    128: {False: (128, 3, 3, 168, 24, False, True, False), True: (128, 3, 3, 160, 24, False, True, False)},
    256: {False: (128, 2, 2, 240, 24, True, False, True), True: (128, 2, 2, 240, 24, True, False, True)},
}
# The magnitude Q's and K's tiles are quantised to where the FP8 Hopper forward sums their scores in float16
# (``fp8_quantize``'s amax_to): 16 * 16 per product, 32768 over head_dim 128, below float16's 65504.
FP8_SCORES_AMAX = 16.0


# K smoothing (``flashtrain.fp8``) subtracts the mean of every (N // SMOOTHING_KEYS)-th key from key 0 (all keys
# below 2 * SMOOTHING_KEYS): any vector leaves the softmax unchanged, and the mean of 256 to 511 keys is within
# ~std / 16 of the full one per channel, far below the shared component it takes off. The mean over all keys read
# all of K once more before its quantisation: 29-38 us of GPU time, the sample 5.5-6.3, at the FP8 table's 4k and
# 16k points on the H200 (benchmarks/NOTES.md, thirty-first session).
SMOOTHING_KEYS = 256


def smoothing_stride(seq: int) -> int:
    """The step between the keys whose mean K smoothing subtracts, for ``seq`` keys."""
    return max(1, seq // SMOOTHING_KEYS)


# As HOPPER_FWD_MIN_SEQ for the FP8 Hopper forward: (head_dim, causal) -> shortest sequence in "auto" mode, None
# for never. The fp8="forward" op's forward with either kernel, B * N = 16k tokens, H * D = 2048, Triton time /
# Hopper time. head_dim 128 (benchmarks/results/fp8_fwd_thresholds_h200_2026-12-01.csv, the three-warpgroup kernel,
# GPU time by CUDA-graph replay): full 1.04 at 1k, 1.19 at 2k, 1.27 at 4k; causal 0.89 at 1k, 1.03 at 2k, 1.15 at
# 4k. head_dim 256 (fp8_fwd_thresholds_h200_2026-11-30.csv): full 1.12 and causal 1.04 at 512 (the shortest
# measured).
FP8_HOPPER_FWD_MIN_SEQ = {(128, False): 1024, (128, True): 2048, (256, False): 512, (256, True): 512}


def fp8_hopper_fwd_meta(head_dim: int, causal: bool) -> dict:
    """The FP8 Hopper forward kernel's constexprs for ``head_dim`` (a key of FP8_HOPPER_FWD_CONFIGS) and ``causal``."""
    (block_n, stages, consumers, consumer_regs, loader_regs, pingpong, f16,
     skip_unit_rescale) = FP8_HOPPER_FWD_CONFIGS[head_dim][causal]
    return dict(BLOCK_N=block_n, STAGES=stages, CONSUMERS=consumers, PINGPONG=pingpong, CONSUMER_REGS=consumer_regs,
                LOADER_REGS=loader_regs, F16_SCORES=f16, SKIP_UNIT_RESCALE=skip_unit_rescale)


# Below these sequence lengths (the longer of seq_q, seq_k) the Triton forward is as fast or faster on the H200
# and "auto" keeps it: (head_dim, causal) -> shortest sequence for the Hopper forward. From the forward sweep of
# benchmarks/results/forward_thresholds_h200_2026-11-30.csv (bf16; head_dim 64: the trainer's layout, 12 heads,
# 32k tokens; head_dim 128: 16 heads, 16k tokens), Triton time / Hopper time: head_dim 64 causal 0.92 at 4k, 1.06
# at 8k, 1.12 at 16k; full 1.02 at 2k, 1.09 at 4k; head_dim 128 causal 0.93 at 1k, 1.08 at 2k; full 1.04 at 1k.
HOPPER_FWD_MIN_SEQ = {(64, False): 2048, (64, True): 8192, (128, False): 1024, (128, True): 2048}
# The Hopper (sm_90) backward of attention_bwd_hopper.py, per head_dim: (STAGES of the Q / dO ring, warpgroup
# registers, loader registers). Fixed, not tuned: the prototype's best on the H200 (benchmarks/NOTES.md, ninth
# and tenth sessions). head_dim 128 has no entry: its dK, dV and dQ accumulators (3 x 64 fp32 registers a
# thread) do not fit beside the scores.
HOPPER_BWD_CONFIGS = {64: (2, 232, 40)}


def hopper_bwd_meta(head_dim: int) -> dict:
    """The Hopper backward kernel's constexprs for ``head_dim`` (a key of HOPPER_BWD_CONFIGS)."""
    stages, consumer_regs, loader_regs = HOPPER_BWD_CONFIGS[head_dim]
    return dict(STAGES=stages, CONSUMER_REGS=consumer_regs, LOADER_REGS=loader_regs)


# As HOPPER_FWD_MIN_SEQ for the backward: causal -> shortest sequence for the Hopper backward in "auto" mode.
# From benchmarks/results/hopper_bwd_sweep_h200_2026-11-30.csv (bf16, head_dim 64, B * N = 32k tokens, 12
# heads), two Triton kernels / Hopper: full 0.97 at 2k, 1.03 at 4k, 1.09-1.11 from 8k; causal 0.90 at 2k, 0.99
# at 4k, 1.07 at 8k, 1.09-1.10 from 16k.
HOPPER_BWD_MIN_SEQ = {False: 4096, True: 8192}

# "auto": the Hopper kernels where HOPPER_FWD_MIN_SEQ / HOPPER_BWD_MIN_SEQ (FP8_HOPPER_FWD_MIN_SEQ for the FP8
# forward, which follows the forward's mode) say they are faster; "always":
# wherever they apply (tests); "never": the Triton kernels everywhere (benchmarks compare the two). See
# ``hopper_forward`` and ``hopper_backward``.
_hopper_modes = {"forward": "auto", "backward": "auto"}


@contextlib.contextmanager
def _hopper_mode(direction: str, mode: str):
    if mode not in ("auto", "always", "never"):
        raise ValueError(f"hopper_{direction} mode={mode!r}; expected 'auto', 'always' or 'never'")
    saved = _hopper_modes[direction]
    _hopper_modes[direction] = mode
    try:
        yield
    finally:
        _hopper_modes[direction] = saved


def hopper_forward(mode: str):
    """Within the block, run the Hopper forwards (16-bit and FP8) per ``mode``: "auto" (the default), "always"
    or "never"."""
    return _hopper_mode("forward", mode)


def hopper_backward(mode: str):
    """Within the block, run the Hopper backward per ``mode``: "auto" (the default), "always" or "never"."""
    return _hopper_mode("backward", mode)


def hopper_forward_mode() -> str:
    return _hopper_modes["forward"]


def hopper_backward_mode() -> str:
    return _hopper_modes["backward"]


# The dK/dV kernel drops its query-row masks when seq_q is a multiple of this (EVEN_M), so every BLOCK_M it may
# launch with (candidates, interpreter and fp64 tiles) must divide it (tests/test_configs.py).
EVEN_M_MULTIPLE = 128

# the autotuner adds the tensors' dtypes; the key-bias / dropout variants are tuned apart (more registers)
TUNE_KEY = ["HEAD_DIM", "CAUSAL", "SEQ_BUCKET", "WAVE_BUCKET", "PRECISION", "HAS_KEY_BIAS", "DROPOUT"]


def _time_candidate(kernel_call, quantiles):
    """The autotuner's timing of one candidate. triton.autotune compiles a candidate inside its first timed
    call, so the GPU idles (and its clocks drop) for the seconds of each compile, right before that
    candidate's 25 ms of warm-up: at N = 1k, where a kernel runs ~0.25 ms, a cold candidate can lose to a
    worse one. So: launch once (compile), then 100 ms of warm-up runs, then the usual 100 ms of timed runs."""
    kernel_call()
    return triton.testing.do_bench(kernel_call, warmup=100, rep=100, quantiles=quantiles)


def autotuned(kernel, candidates, wide_candidates, extra_key=()):
    """``kernel`` wrapped in triton.autotune over both lists, pruned to the one for the launch's head_dim;
    tuning results are cached on disk, so they survive restarts. ``extra_key``: more constexpr arguments that
    get a pick of their own."""
    wide_ids = {id(c) for c in wide_candidates}

    def for_head_dim(configs, named_args, **meta):
        wide = meta["HEAD_DIM"] > WIDE_HEAD_DIM
        return [c for c in configs if (id(c) in wide_ids) == wide]

    return triton.autotune(configs=[*candidates, *wide_candidates], key=[*TUNE_KEY, *extra_key], cache_results=True,
                           prune_configs_by={"early_config_prune": for_head_dim}, do_bench=_time_candidate)(kernel)


_forced: dict[str, dict] = {}


@contextlib.contextmanager
def forced_configs(**per_kernel: triton.Config):
    """Within the block, launch e.g. ``fwd=cfg`` with that config instead of autotuning (tests use it to
    check every candidate the tuner may pick)."""
    saved = dict(_forced)
    for name, cfg in per_kernel.items():
        _forced[name] = dict(**cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(saved)


def is_forced(name: str) -> bool:
    """Whether ``forced_configs`` currently forces kernel ``name``."""
    return name in _forced


# The autotuner's pick per launch key, looked up before triton.autotune's own: the Autotuner builds its key
# on every call from a dict of all ~40 arguments and str() of each tensor's dtype, which was the largest single
# item of the forward's host time on the GPU box (165 us per call; benchmarks/NOTES.md), and a short kernel
# (N = 1k) waits for the host. The key here holds everything the autotuner's does (meta-parameters, the
# sequence and wave buckets, every tensor's dtype), so it never reuses a pick across the autotuner's keys.
_picks: dict[tuple, dict] = {}


def write_tuning_picks(path: str) -> int:
    """Write what each autotuned launch key of this process ran with (picked here or read from Triton's disk
    cache) to a CSV: kernel ('fwd', 'dkdv', 'dq'), key (sequence and wave buckets, tensor dtypes, compile-time
    arguments), BLOCK_M, BLOCK_N, num_warps, num_stages. For the benchmarks' records; returns the row count."""
    fields = ["BLOCK_M", "BLOCK_N", "num_warps", "num_stages"]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["kernel", "key", *fields])
        for key, cfg in _picks.items():
            writer.writerow([key[0], repr(key[1:]), *(cfg[k] for k in fields)])
    return len(_picks)


def launch(name: str, tuned, kernel, grid_fn, args, dtype: torch.dtype, seq_len: int, **meta):
    """Launch ``kernel`` ('fwd', 'dkdv' or 'dq') with a fixed config (interpreter, fp64, forced) or with the
    config ``tuned``, its autotuned wrapper, picks (the first launch of a key tunes, later ones reuse the pick).
    ``args`` ends with the SEQ_BUCKET and WAVE_BUCKET keys; ``grid_fn`` maps the config's meta-parameters to a grid;
    ``seq_len`` (the longer of seq_q, seq_k) picks the interpreter's tiles."""
    if name in _forced:
        cfg = _forced[name]
    elif INTERPRET or dtype == torch.float64:
        cfg = fixed_config(name, dtype == torch.float64, meta["BLOCK_D"], seq_len)
    else:
        key = (name, *args[-2:], *(a.dtype for a in args if isinstance(a, torch.Tensor)), *meta.items())
        cfg = _picks.get(key)
        if cfg is None:
            tuned[grid_fn](*args, **meta)
            _picks[key] = tuned.best_config.all_kwargs()
            return
    launch_kernel(kernel, grid_fn(cfg), *args, **meta, **cfg)
