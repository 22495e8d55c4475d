"""Fixed configurations of the Hopper (sm_90) Gluon kernels, per head_dim: tiles, pipeline stages, warpgroups and
their register split. Not tuned: picked by sweeps on an H200 (docs/tuning.md). Shared memory and registers must fit
an SM (227 KB, 64K registers); the comments give the budget.
"""

from __future__ import annotations

# 16-bit forward: (BLOCK_N, STAGES, CONSUMERS, consumer warpgroup registers, loader registers, ping-pong when
# causal, ping-pong otherwise). Shared memory STAGES * 2 * BLOCK_N * D * 2 bytes of K/V plus CONSUMERS * 64 * D * 2
# of Q: 224 KB at D = 128.
HOPPER_FWD_CONFIGS = {
    64: (128, 3, 3, 160, 32, True, True),
    128: (128, 3, 2, 232, 40, True, False),
}

# Backward: (STAGES of the Q / dO ring, warpgroup registers, loader registers). head_dim 128 has no entry: its dK,
# dV and dQ accumulators (3 x 64 fp32 registers a thread) do not fit beside the scores.
HOPPER_BWD_CONFIGS = {64: (2, 232, 40)}

# FP8 forward, per head_dim (Q / K rows after the rotation's padding, equal to V's) and causal: (BLOCK_N, STAGES,
# softmax warpgroups, their registers, loader registers, ping-pong, scores summed in float16, output rescale skipped
# where its factors are 1). BLOCK_N divides the K/V quantisation tile; shared memory STAGES * 2 * BLOCK_N * D bytes
# of K and V^T plus 64 * D per warpgroup of Q.
FP8_HOPPER_FWD_CONFIGS = {
    128: {False: (128, 3, 3, 168, 24, False, True, False), True: (128, 3, 3, 160, 24, False, True, False)},
    256: {False: (128, 2, 2, 240, 24, True, False, True), True: (128, 2, 2, 240, 24, True, False, True)},
}
# With float16 scores, Q's and K's tiles are quantised to this magnitude: 16 * 16 per product, 32768 over head_dim
# 128, below float16's 65504.
FP8_SCORES_AMAX = 16.0


def hopper_fwd_meta(head_dim: int, causal: bool) -> dict:
    """The 16-bit Hopper forward's tile constexprs for ``head_dim`` (a key of HOPPER_FWD_CONFIGS)."""
    block_n, stages, consumers, consumer_regs, loader_regs, pp_causal, pp_full = HOPPER_FWD_CONFIGS[head_dim]
    return dict(BLOCK_N=block_n, STAGES=stages, CONSUMERS=consumers, PINGPONG=pp_causal if causal else pp_full,
                CONSUMER_REGS=consumer_regs, LOADER_REGS=loader_regs)


def hopper_bwd_meta(head_dim: int) -> dict:
    """The Hopper backward's constexprs for ``head_dim`` (a key of HOPPER_BWD_CONFIGS)."""
    stages, consumer_regs, loader_regs = HOPPER_BWD_CONFIGS[head_dim]
    return dict(STAGES=stages, CONSUMER_REGS=consumer_regs, LOADER_REGS=loader_regs)


def fp8_hopper_fwd_meta(head_dim: int, causal: bool) -> dict:
    """The FP8 Hopper forward's constexprs for ``head_dim`` (a key of FP8_HOPPER_FWD_CONFIGS) and ``causal``."""
    (block_n, stages, consumers, consumer_regs, loader_regs, pingpong, f16,
     skip_unit_rescale) = FP8_HOPPER_FWD_CONFIGS[head_dim][causal]
    return dict(BLOCK_N=block_n, STAGES=stages, CONSUMERS=consumers, PINGPONG=pingpong, CONSUMER_REGS=consumer_regs,
                LOADER_REGS=loader_regs, F16_SCORES=f16, SKIP_UNIT_RESCALE=skip_unit_rescale)


def fp8_scores_in_f16(head_dim: int) -> bool:
    """Whether the FP8 Hopper forward at ``head_dim`` sums its scores in float16: then Q and K are quantised to
    FP8_SCORES_AMAX and the scores' scale is used as its float16 value."""
    return head_dim in FP8_HOPPER_FWD_CONFIGS and fp8_hopper_fwd_meta(head_dim, False)["F16_SCORES"]
