"""Autotuning of the 16-bit Triton kernels: candidate timing, the launch key, the cache of picks, forced configs.

On the GPU each kernel picks among a short list of tiles (``attention/tiles.py``) with ``triton.autotune``, once per
key: head_dim, causal, dtypes, feature flags, a power-of-two sequence bucket and the grid's size in waves over the
SMs. Picks are cached on disk by Triton (shared by every process) and in this process by ``launch_tuned``, whose
key is looked up before Triton's own (that lookup cost more host time than the rest of a short call). Triton's
interpreter and float64 launch fixed tiles instead. docs/tuning.md says why each choice was made.
"""

from __future__ import annotations

import contextlib
import csv

import torch
import triton

from .common import cdiv, next_power_of_2
from .launch import INTERPRET, launch_kernel, sm_count

SEQ_BUCKET_CAP = 16384  # sequences from here on share one pick: the fastest tile no longer changes with length
WAVE_BUCKET_ROWS = 128  # rows a program, for counting a launch's programs before its tile is known
# Longer launches tune on a proxy: the shape cut to the rows that give the same tuning keys (``proxy_rows``), so a
# first call at 1M tokens times each candidate on 64k-256k rows instead of the whole launch
TUNE_PROXY_ABOVE = 65536

# the autotuner adds the tensors' dtypes; the window, varlen, key-bias and dropout variants are tuned apart
TUNE_KEY = ["HEAD_DIM", "CAUSAL", "LOCAL", "VARLEN", "SEQ_BUCKET", "WAVE_BUCKET", "PRECISION", "HAS_KEY_BIAS",
            "DROPOUT"]


def seq_bucket(seq_len: int) -> int:
    """Autotune key for a sequence length: its power-of-two bucket, capped at SEQ_BUCKET_CAP."""
    return min(next_power_of_2(max(seq_len, 1)), SEQ_BUCKET_CAP)


def wave_bucket(pairs: int, rows: int, device: torch.device) -> int:
    """Autotune key for a launch's size: its programs (``pairs`` (batch, head) pairs of ``rows`` rows each, at
    WAVE_BUCKET_ROWS rows a program) in waves over the device's SMs, rounded up to a power of two and capped at 8
    (1 for CPU tensors). The fastest tile differs between a grid that leaves SMs idle and one that fills the GPU
    many times over, and Triton's disk cache of picks is shared by every process."""
    if device.type != "cuda":
        return 1
    return min(next_power_of_2(cdiv(pairs * cdiv(rows, WAVE_BUCKET_ROWS), sm_count(device))), 8)


def proxy_rows(pairs: int, seq: int, device: torch.device) -> int | None:
    """Rows of the proxy a launch of ``pairs`` (batch, head) pairs of ``seq`` rows tunes on, or None (it tunes on
    itself): the shortest power of two from SEQ_BUCKET_CAP whose grid falls in the launch's wave bucket, so the
    proxy's tuning keys (sequence and wave buckets) are the launch's; only from TUNE_PROXY_ABOVE rows, and only
    where the proxy is at most half the launch."""
    if seq <= TUNE_PROXY_ABOVE:
        return None
    want, rows = wave_bucket(pairs, seq, device), SEQ_BUCKET_CAP
    while wave_bucket(pairs, rows, device) < want:
        rows *= 2
    return rows if 2 * rows <= seq else None


def _time_candidate(kernel_call, quantiles):
    """The autotuner's timing of one candidate. triton.autotune compiles a candidate inside its first timed call,
    so the GPU idles (and its clocks drop) right before that candidate's warm-up, and a cold candidate can lose to
    a worse one. So: launch once (compile), then 100 ms of warm-up runs, then 100 ms of timed runs."""
    kernel_call()
    return triton.testing.do_bench(kernel_call, warmup=100, rep=100, quantiles=quantiles)


def autotuned(kernel, candidates, wide_candidates, wide_above: int, extra_key=()):
    """``kernel`` wrapped in triton.autotune over both lists, pruned to ``wide_candidates`` where HEAD_DIM >
    ``wide_above`` and to ``candidates`` elsewhere; picks are cached on disk, so they survive restarts.
    ``extra_key``: more constexpr arguments that get a pick of their own."""
    wide_ids = {id(c) for c in wide_candidates}

    def for_head_dim(configs, named_args, **meta):
        wide = meta["HEAD_DIM"] > wide_above
        return [c for c in configs if (id(c) in wide_ids) == wide]

    return triton.autotune(configs=[*candidates, *wide_candidates], key=[*TUNE_KEY, *extra_key], cache_results=True,
                           prune_configs_by={"early_config_prune": for_head_dim}, do_bench=_time_candidate)(kernel)


_forced: dict[str, dict] = {}


@contextlib.contextmanager
def forced_configs(**per_kernel: triton.Config):
    """Within the block, launch e.g. ``fwd=cfg`` with that config instead of autotuning (tests use it to check
    every candidate the tuner may pick). A forced Triton kernel also keeps the Hopper kernels that would replace
    it from running (``flashtrain.ops.dispatch``)."""
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


# The autotuner's pick per launch key, looked up before triton.autotune's own. The key holds everything the
# autotuner's does (meta-parameters, the sequence and wave buckets, every tensor's dtype), so a pick is never
# reused across the autotuner's keys.
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


def launch_tuned(name: str, tuned, kernel, grid_fn, args, fixed: dict | None, proxy=None, **meta) -> None:
    """Launch ``kernel`` ('fwd', 'dkdv' or 'dq') with a forced config, with ``fixed`` (the interpreter's and
    float64's tiles; None on the autotuned path), or with the config ``tuned``, its autotuned wrapper, picks (the
    first launch of a key tunes, later ones reuse the pick). ``args`` ends with the SEQ_BUCKET and WAVE_BUCKET
    keys; ``grid_fn`` maps the config's meta-parameters to a grid. ``proxy``: None, or a function returning the
    (grid_fn, args) of a smaller launch with the same keys, which the first launch of a key tunes on instead."""
    if name in _forced:
        cfg = _forced[name]
    elif fixed is not None:
        cfg = fixed
    else:
        key = (name, *args[-2:], *(a.dtype for a in args if isinstance(a, torch.Tensor)), *meta.items())
        cfg = _picks.get(key)
        if cfg is None and proxy is None:
            tuned[grid_fn](*args, **meta)
            _picks[key] = tuned.best_config.all_kwargs()
            return
        if cfg is None:
            proxy_grid, proxy_args = proxy()
            tuned[proxy_grid](*proxy_args, **meta)
            cfg = _picks[key] = tuned.best_config.all_kwargs()
    launch_kernel(kernel, grid_fn(cfg), *args, **meta, **cfg)


def uses_fixed_tiles(dtype: torch.dtype) -> bool:
    """Whether launches of ``dtype`` take fixed tiles instead of autotuning: in Triton's interpreter, and for
    float64 (which exists for exactness checks, not speed)."""
    return INTERPRET or dtype == torch.float64
