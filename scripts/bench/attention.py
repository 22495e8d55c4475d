"""Attention benchmark: flashtrain against PyTorch's own attention, side by side in one run.

Speed: TFLOP/s of forward and backward, bf16, on the grid batch*seq = 16k tokens, heads*head_dim = 2048,
head_dim 64 and 128, seq 1k..16k, causal and not; plus head_dim 256, seq 32k and GQA (4 query heads per
KV head). Providers: flashtrain, SDPA's flash / cuDNN / efficient backends, FlexAttention (compiled); on
request (--providers) flashtrain's FP8 path: flashtrain_fp8_fwd (fp8="forward") and flashtrain_fp8 ("full"),
and flashtrain with its forward kernel fixed: flashtrain_triton (the Triton forward), flashtrain_hopper (the
warp-specialised Hopper forward wherever it applies); plain flashtrain picks between them. flashtrain_split_dkdv and
flashtrain_fused_dkdv: the Triton backward with dK and dV in two launches or in one (``dispatch.split_dkdv``).
FLOPs: forward 4*B*H*N*N*D (half when causal), backward 2.5x forward. Medians of triton.testing.do_bench,
each after one untimed call (compile, autotune) and 0.3 s of GPU warm-up.

Memory: peak memory of forward+backward beyond the inputs, B=1, H=16, D=128, causal, seq 4k..32k, for
flashtrain, SDPA (default backend) and eager PyTorch attention (matmul-softmax-matmul); OOM is recorded.

Writes long-format CSV rows (provider, dtype, D, N, B, H, H_kv, causal, mode, ms, tflops, peak_gib, status,
gpu, torch, triton, commit, date) to --out. Needs a CUDA GPU.

    python scripts/bench/attention.py --out benchmarks/results/attention.csv
    python scripts/bench/attention.py --fp8-table all --out FP8.csv --gpu-time-out FP8_GPU.csv  # the FP8 table
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
from flashtrain.kernels import tuning
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtrain import flash_attention
from flashtrain.ops import dispatch
from flashtrain.trainer import backends as attention_backends

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/bench: the shared provenance columns
import provenance  # noqa: E402

FIELDS = ["provider", "dtype", "D", "N", "B", "H", "H_kv", "causal", "mode", "ms", "tflops", "peak_gib",
          "status", *provenance.FIELDS]
SDPA_BACKENDS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                 "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}
PROVIDERS = ["flashtrain", *SDPA_BACKENDS, "flex"]
# optional (--providers): flashtrain's FP8 path; "forward" times the FP8 forward with the 16-bit backward,
# "full" the FP8 forward and the FP8 backward; the "_nosmooth" variants switch K smoothing off (its cost)
FP8_PROVIDERS = {"flashtrain_fp8_fwd": "forward", "flashtrain_fp8": "full",
                 "flashtrain_fp8_fwd_nosmooth": "forward", "flashtrain_fp8_nosmooth": "full"}
# optional: flashtrain with its forward kernel chosen by hand (dispatch.hopper_forward), "flashtrain" being "auto":
# the Triton forward everywhere, or the warp-specialised Hopper forward wherever it applies
FORWARD_PROVIDERS = {"flashtrain_triton": "never", "flashtrain_hopper": "always"}
# optional: flashtrain with dK and dV in two launches of its Triton backward, or in one (dispatch.split_dkdv)
SPLIT_PROVIDERS = {"flashtrain_split_dkdv": "always", "flashtrain_fused_dkdv": "never"}
SPEED_PROVIDERS = [*PROVIDERS, *FP8_PROVIDERS, *FORWARD_PROVIDERS, *SPLIT_PROVIDERS]  # what --providers accepts


def attention_flops(batch, heads, seq, head_dim, causal, mode):
    flops = 4 * batch * heads * seq * seq * head_dim
    flops = flops / 2 if causal else flops
    return flops * 2.5 if mode == "bwd" else flops


_flex_cache: dict = {}


def make_provider(name, causal, seq, gqa):
    """fn(q, k, v) -> out for one provider (q: (B, H, N, D), k/v: (B, H_kv, N, D))."""
    if name == "flashtrain":
        return lambda q, k, v: flash_attention(q, k, v, causal=causal)
    if name in FORWARD_PROVIDERS:
        def flashtrain_forward(q, k, v, mode=FORWARD_PROVIDERS[name]):
            with dispatch.hopper_forward(mode):
                return flash_attention(q, k, v, causal=causal)
        return flashtrain_forward
    if name in SPLIT_PROVIDERS:  # bench_speed sets the mode: the backward reads it when it runs
        return lambda q, k, v: flash_attention(q, k, v, causal=causal)
    if name in FP8_PROVIDERS:
        smooth_k = not name.endswith("_nosmooth")
        return lambda q, k, v: flash_attention(q, k, v, causal=causal, fp8=FP8_PROVIDERS[name], smooth_k=smooth_k)
    if name in SDPA_BACKENDS:
        backend = SDPA_BACKENDS[name]

        def sdpa(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        return sdpa
    if name == "sdpa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    if name == "eager":
        return lambda q, k, v: attention_backends.eager(q, k, v, causal=causal)
    if name == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        if "fn" not in _flex_cache:
            _flex_cache["fn"] = torch.compile(flex_attention, dynamic=False)
        block_mask = None
        if causal:
            block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None, seq, seq)
        return lambda q, k, v: _flex_cache["fn"](q, k, v, block_mask=block_mask, enable_gqa=gqa)
    known = [*SPEED_PROVIDERS, "sdpa", "eager"]
    raise ValueError(f"unknown provider {name!r}; expected one of {known}")


def bench_speed(provider, batch, heads, heads_kv, seq, head_dim, causal, dtype):
    """Median ms of forward and of backward; returns {mode: ms}."""
    q = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(batch, heads_kv, seq, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(batch, heads_kv, seq, head_dim, device="cuda", dtype=dtype, requires_grad=True)
    split = SPLIT_PROVIDERS.get(provider)
    with dispatch.split_dkdv(split) if split else contextlib.nullcontext():
        return time_directions(make_provider(provider, causal, seq, heads != heads_kv), q, k, v)


def time_directions(fn, q, k, v):
    """Median ms of ``fn(q, k, v)``'s forward and of its backward: {mode: ms}."""
    # each direction runs once (compiling / autotuning: seconds with the GPU idle), then the GPU is brought
    # back to its clocks before it is timed (docs/performance-notes.md: the N = 1k swings)
    out = fn(q, k, v)
    dout = torch.randn_like(out)
    out.backward(dout, retain_graph=True)
    warm_up_gpu(0.3)
    fwd = triton.testing.do_bench(lambda: fn(q, k, v), warmup=100, rep=300, return_mode="median")
    warm_up_gpu(0.3)
    bwd = triton.testing.do_bench(lambda: out.backward(dout, retain_graph=True), warmup=100, rep=300,
                                  grad_to_none=[q, k, v], return_mode="median")
    return {"fwd": fwd, "bwd": bwd}


def forward_gpu_us(provider, batch, heads, heads_kv, seq, head_dim, causal, dtype, calls=10, replays=20,
                   settle_s=2.0):
    """GPU time of one forward call, us: the median over ``replays`` of a CUDA graph of ``calls`` forwards, divided
    by ``calls``, after ``settle_s`` seconds of replaying that graph. A graph replays the kernels without the host,
    so where the op's host time (Python, launches) exceeds its GPU time, this is what do_bench cannot see.

    Why the settling: under sustained load the H200 sits at its 700 W cap, and its SM clock then depends on the
    kernels (after 3 s of replays, (4, 16, 4096, 128) causal: bf16 1695 MHz, fp8="forward" 1905; from 1980 at
    rest), so a time taken just after other work (do_bench and a 0.3 s warm-up of bf16 matmuls) depends on that
    work. Settled, each provider is timed in its own steady
    state, as in training. The replays: ``replay_us`` (timed from an idle GPU, the host's launch of the graph, a
    node per kernel, 60 for ten calls of the FP8 op at 4k and 10 for bf16's, would be timed with it)."""
    q, k, v = (torch.randn(batch, h, seq, head_dim, device="cuda", dtype=dtype) for h in (heads, heads_kv, heads_kv))
    fn = make_provider(provider, causal, seq, heads != heads_kv)
    graph = capture_graph(lambda: fn(q, k, v), calls)
    end_settle = time.time() + settle_s
    while time.time() < end_settle:
        graph.replay()
        torch.cuda.synchronize()
    times = sorted(replay_us(graph, calls, replays))
    return times[len(times) // 2]


def capture_graph(fn, calls: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` calls of ``fn()`` without autograd, captured after three calls outside it on a
    side stream (compiling, tuning and allocating there)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, calls: int, replays: int, after_each=None) -> list[float]:
    """Microseconds a call in each of ``replays`` timed replays of ``graph`` (``calls`` calls in it); each is queued
    behind an untimed replay, so that the host's launch of the graph is not timed with it. ``after_each()``: called
    after each timed replay (e.g. to read the clock)."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()  # untimed: the timed replay is launched while the GPU runs this one
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
        if after_each is not None:
            after_each()
    return times


def bench_memory(provider, seq, batch=1, heads=16, head_dim=128, causal=True, dtype=torch.bfloat16):
    """Peak GiB allocated by forward + backward beyond the inputs (q, k, v, dout)."""
    torch.cuda.empty_cache()
    q, k, v, dout = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=dtype) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    fn = make_provider(provider, causal, seq, False)
    fn(q, k, v).backward(dout)  # warm-up: compile/tune outside the measurement
    q.grad = k.grad = v.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn(q, k, v).backward(dout)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def warm_up_gpu(seconds: float = 3.0):
    """Bring the GPU to its working clocks before anything is timed or autotuned (the first point of a
    cold run once measured 35% below the same kernel warm)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.time() + seconds
    while time.time() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def main_grid(seqs, head_dims=(64, 128)):
    """(B, H, H_kv, N, D, causal): batch*seq = 16k tokens, heads*head_dim = 2048; head_dims in the order given."""
    return [(16384 // seq, 2048 // head_dim, 2048 // head_dim, seq, head_dim, causal)
            for head_dim in head_dims for seq in seqs for causal in (False, True)]


def extra_grid():
    """head_dim 256, seq 32k, and GQA (4 query heads per KV head)."""
    points = []
    for causal in (False, True):
        points += [(16384 // seq, 8, 8, seq, 256, causal) for seq in (4096, 16384)]
        points.append((1, 16, 16, 32768, 128, causal))
        points.append((1, 16, 4, 16384, 128, causal))
    return points


def bench_point(point, providers, flex_seqs, meta, record, start):
    """Time every provider on one (B, H, H_kv, N, D, causal) point; record a row per (provider, mode)."""
    batch, heads, heads_kv, seq, head_dim, causal = point
    for provider in providers:
        if provider == "flex" and (seq not in flex_seqs or head_dim > 128):
            continue
        row = dict(provider=provider, dtype="bf16", D=head_dim, N=seq, B=batch, H=heads, H_kv=heads_kv,
                   causal=causal, **meta)
        results = []
        try:
            times = bench_speed(provider, batch, heads, heads_kv, seq, head_dim, causal, torch.bfloat16)
            for mode, ms in times.items():
                tflops = attention_flops(batch, heads, seq, head_dim, causal, mode) / ms / 1e9
                results.append(dict(row, mode=mode, ms=f"{ms:.4f}", tflops=f"{tflops:.1f}", status="ok"))
        except Exception as exc:  # a backend that does not support a shape is a result, not a crash
            status = "OOM" if isinstance(exc, torch.OutOfMemoryError) else f"error: {type(exc).__name__}"
            results = [dict(row, mode=mode, status=status) for mode in ("fwd", "bwd")]
            torch.cuda.empty_cache()
        for r in results:
            record(r)
        summary = " ".join(f"{r['mode']} {r.get('tflops') or r['status']}" for r in results)
        progress(start, provider, point, summary)


def progress(start, provider, point, result):
    """One progress line: seconds since ``start``, the provider, the (B, H, H_kv, N, D, causal) point, a result."""
    _, heads, heads_kv, seq, head_dim, causal = point
    print(f"[{time.time() - start:6.0f}s] {provider:15s} D={head_dim:3d} N={seq:5d} H={heads}/{heads_kv} "
          f"causal={causal!s:5s} {result}", flush=True)


def memory(meta, record, start):
    """Peak extra memory of forward+backward: flashtrain, SDPA (default backend), eager."""
    for seq in (4096, 8192, 16384, 32768):
        for provider in ("flashtrain", "sdpa", "eager"):
            row = dict(provider=provider, dtype="bf16", D=128, N=seq, B=1, H=16, H_kv=16, causal=True,
                       mode="fwd+bwd", **meta)
            try:
                peak = bench_memory(provider, seq)
                row.update(peak_gib=f"{peak:.3f}", status="ok")
            except torch.OutOfMemoryError:
                row.update(status="OOM")
                torch.cuda.empty_cache()
            record(row)
            print(f"[{time.time() - start:6.0f}s] memory {provider:10s} N={seq:5d} {row.get('peak_gib', 'OOM')}",
                  flush=True)


# the README's FP8 table: (B, H, H_kv, N, D, causal), timed for bf16, fp8="forward" and fp8="full"
FP8_TABLE = [(1, 32, 32, 16384, 64, True), (4, 16, 16, 4096, 128, False), (4, 16, 16, 4096, 128, True),
             (1, 16, 16, 16384, 128, False), (1, 16, 16, 16384, 128, True), (4, 8, 8, 4096, 256, False),
             (4, 8, 8, 4096, 256, True), (1, 8, 8, 16384, 256, False)]
FP8_TABLE_PROVIDERS = ["flashtrain", "flashtrain_fp8_fwd", "flashtrain_fp8"]
GPU_TIME_FIELDS = ["provider", "D", "N", "B", "H", "H_kv", "causal", "fwd_gpu_us", "method", *provenance.FIELDS]


def fp8_table(subset, meta, record, gpu_time_out, start):
    """The README's FP8 table (``subset``: "all", "4k" or "256": the 256 rows at 4k causal and 16k), each point's
    providers side by side; with ``gpu_time_out``, also each forward's GPU time, bf16 and fp8="forward"
    (``forward_gpu_us``), as CSV rows for ``report.py --gpu-time``."""
    points = {"all": FP8_TABLE, "4k": [p for p in FP8_TABLE if p[3] == 4096],
              "256": [p for p in FP8_TABLE if p[4] == 256 and (p[5] or p[3] != 4096)]}[subset]
    out = writer = None
    if gpu_time_out:
        out = open(gpu_time_out, "w", newline="")
        writer = csv.DictWriter(out, fieldnames=GPU_TIME_FIELDS)
        writer.writeheader()
    for point in points:
        bench_point(point, FP8_TABLE_PROVIDERS, [], meta, record, start)
        if writer is None:
            continue
        batch, heads, heads_kv, seq, head_dim, causal = point
        for provider in FP8_TABLE_PROVIDERS[:2]:
            us = forward_gpu_us(provider, batch, heads, heads_kv, seq, head_dim, causal, torch.bfloat16)
            writer.writerow(dict(provider=provider, D=head_dim, N=seq, B=batch, H=heads, H_kv=heads_kv,
                                 causal=causal, fwd_gpu_us=f"{us:.1f}", method="cuda_graph_settled", **meta))
            out.flush()
            progress(start, provider, point, f"fwd GPU time {us:.1f} us")
    if out is not None:
        out.close()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/attention.csv")
    parser.add_argument("--providers", nargs="+", default=PROVIDERS,
                        choices=SPEED_PROVIDERS)
    parser.add_argument("--seqs", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--flex-seqs", nargs="+", type=int, default=None,
                        help="time Flex only at these N (default: every N of --seqs; Flex compiles once per shape, "
                             "~10 s each)")
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128],
                        help="main grid head dims, timed in this order")
    parser.add_argument("--main-grid-only", action="store_true")
    parser.add_argument("--skip-main-grid", action="store_true", help="only the memory and extra points")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--tuning-out", default=None, help="CSV of the autotuner's picks per key")
    parser.add_argument("--fp8-table", choices=["all", "4k", "256"], default=None,
                        help="time only the README's FP8 table (bf16, fp8 forward and full); '4k' / '256': a subset")
    parser.add_argument("--gpu-time-out", default=None,
                        help="with --fp8-table: a CSV of each forward's GPU time by CUDA-graph replay")
    args = parser.parse_args(argv)
    if args.gpu_time_out and not args.fp8_table:
        parser.error("--gpu-time-out goes with --fp8-table")
    if not torch.cuda.is_available():
        sys.exit("scripts/bench/attention.py needs a CUDA GPU")
    torch._dynamo.config.cache_size_limit = 256  # Flex recompiles per shape
    meta = provenance.provenance()
    out = open(args.out, "w", newline="")
    writer = csv.DictWriter(out, fieldnames=FIELDS, restval="")
    writer.writeheader()
    rows = []

    def record(row):  # written at once: a run cut short keeps what it measured
        rows.append(row)
        writer.writerow(row)
        out.flush()

    warm_up_gpu()
    start = time.time()

    def speed(points):
        for point in points:
            bench_point(point, args.providers, args.flex_seqs or args.seqs, meta, record, start)

    if args.fp8_table:
        fp8_table(args.fp8_table, meta, record, args.gpu_time_out, start)
    elif not args.skip_main_grid:
        speed(main_grid(args.seqs, args.head_dims))
    if not args.skip_memory and not args.fp8_table:
        memory(meta, record, start)
    if not args.main_grid_only and not args.fp8_table:
        speed(extra_grid())
    out.close()
    print(f"wrote {len(rows)} rows to {args.out}")
    if args.tuning_out:
        tuning.write_tuning_picks(args.tuning_out)


if __name__ == "__main__":
    main()
