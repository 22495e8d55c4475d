"""GPU diagnostics behind benchmarks/NOTES.md (third session): the N=1k causal forward taken apart (repeats,
no_grad, every forward candidate, a CUDA-graph replay, SDPA flash), host time per call, and tile sweeps of the
FP8 forward and backward against the bf16 kernels. Prints JSON lines and a summary; writes diag1.json and a
host profile to $OUT; ``fp8acc`` measures how precisely FP8 ``tl.dot`` accumulates. Fifth session:
``profile16k`` (per-kernel CUDA time of gpt2-small training steps at 16k, flash against SDPA) and ``bwdtiles``
(head_dim-64 causal tiles of the forward and of each backward kernel at 16k, cuDNN beside them). Twenty-seventh
session: ``launches`` (each kernel's GPU time in one forward + backward, bf16 and both FP8 modes, (4, 16, 4096,
128)). Thirty-fourth session: ``bwdsections`` (the causal backwards' launch sections against head by head,
the op's backward). Fortieth session: ``power`` (the forward's GPU time by CUDA-graph replay, bf16 and
fp8="forward", after 2 s idle and after 3 s of replays, with the SM clock and power beside it; first run as
devrun/clocks.py, logs/fp8_run26_27_seq_mean_h200_2026-12-02.txt, which timed each replay from an idle GPU). Needs
a CUDA GPU.

    OUT=/tmp python benchmarks/gpu_diagnostics.py short host fp8fwd fp8bwd fp8acc profile16k bwdtiles launches
    OUT=/tmp python benchmarks/gpu_diagnostics.py bwdsections
    OUT=/tmp python benchmarks/gpu_diagnostics.py power
"""
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from flashtrain import flash_attention
from flashtrain.kernels import configs

OUT = os.environ.get("OUT", "/tmp")
rows = []
section = sys.argv[1:] or ["short", "host", "fp8fwd", "fp8bwd"]


def log(**r):
    rows.append(r)
    print(json.dumps(r), flush=True)


def tf(B, H, N, D, causal, ms, bwd=False):
    f = 4 * B * H * N * N * D * (0.5 if causal else 1.0) * (2.5 if bwd else 1.0)
    return round(f / ms / 1e9, 1)


def rnd(B, H, N, D, grad=False):
    return [torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, requires_grad=grad) for _ in range(3)]


# warm the GPU
x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
t0 = time.time()
while time.time() - t0 < 2:
    x @ x
torch.cuda.synchronize()

if "short" in section:
    for D, B, H in ((64, 16, 32), (128, 16, 16)):
        N = 1024
        q, k, v = rnd(B, H, N, D, grad=True)
        for rep in range(3):
            ms = do_bench(lambda: flash_attention(q, k, v, causal=True), warmup=100, rep=300, return_mode="median")
            log(sec="short", what=f"bench-like grad rep{rep}", D=D, ms=ms, tf=tf(B, H, N, D, True, ms))
        with torch.no_grad():
            ms = do_bench(lambda: flash_attention(q, k, v, causal=True), warmup=100, rep=300, return_mode="median")
            log(sec="short", what="no_grad", D=D, ms=ms, tf=tf(B, H, N, D, True, ms))
            for cfg in configs.FWD_CANDIDATES:
                with configs.forced_configs(fwd=cfg):
                    ms = do_bench(lambda: flash_attention(q, k, v, causal=True), warmup=100, rep=300,
                                  return_mode="median")
                log(sec="short", what=f"forced {cfg.kwargs} w{cfg.num_warps} s{cfg.num_stages}", D=D, ms=ms,
                    tf=tf(B, H, N, D, True, ms))
            # CUDA graph: no host in the timed loop
            qs, ks, vs = (t.detach().clone() for t in (q, k, v))
            flash_attention(qs, ks, vs, causal=True)
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                flash_attention(qs, ks, vs, causal=True)
                with torch.cuda.graph(g, stream=s):
                    flash_attention(qs, ks, vs, causal=True)
            torch.cuda.current_stream().wait_stream(s)
            ms = do_bench(lambda: g.replay(), warmup=100, rep=300, return_mode="median")
            log(sec="short", what="cuda graph", D=D, ms=ms, tf=tf(B, H, N, D, True, ms))
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                ms = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), warmup=100, rep=300,
                              return_mode="median")
            log(sec="short", what="sdpa flash no_grad", D=D, ms=ms, tf=tf(B, H, N, D, True, ms))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ms = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), warmup=100, rep=300,
                          return_mode="median")
        log(sec="short", what="sdpa flash grad", D=D, ms=ms, tf=tf(B, H, N, D, True, ms))
        ms = do_bench(lambda: flash_attention(q, k, v, causal=True), warmup=100, rep=300, return_mode="median")
        log(sec="short", what="bench-like grad after sdpa", D=D, ms=ms, tf=tf(B, H, N, D, True, ms))
        del q, k, v

if "host" in section:
    q, k, v = rnd(1, 1, 128, 64, grad=True)
    for name, fn in (("flash grad", lambda: flash_attention(q, k, v, causal=True)),
                     ("sdpa grad", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(2000):
            fn()
        host = (time.perf_counter() - t) / 2000 * 1e6
        torch.cuda.synchronize()
        log(sec="host", what=name, us_per_call=round(host, 1))
    with torch.no_grad():
        for _ in range(50):
            flash_attention(q, k, v, causal=True)
        t = time.perf_counter()
        for _ in range(2000):
            flash_attention(q, k, v, causal=True)
        log(sec="host", what="flash no_grad", us_per_call=round((time.perf_counter() - t) / 2000 * 1e6, 1))
    out = flash_attention(q, k, v, causal=True)
    g = torch.randn_like(out)
    for _ in range(20):
        out.backward(g, retain_graph=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(1000):
        out.backward(g, retain_graph=True)
    log(sec="host", what="flash bwd", us_per_call=round((time.perf_counter() - t) / 1000 * 1e6, 1))
    import cProfile
    import pstats
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(2000):
        flash_attention(q, k, v, causal=True)
    pr.disable()
    with open(f"{OUT}/host_profile.txt", "w") as fh:
        pstats.Stats(pr, stream=fh).sort_stats("tottime").print_stats(30)

FP8_FWD_SWEEP = [(128, 64, 8, 2), (128, 128, 8, 2), (128, 64, 4, 2), (128, 64, 8, 3), (128, 128, 8, 3),
                 (64, 64, 4, 3), (128, 32, 4, 3), (256, 64, 8, 2)]
if "fp8fwd" in section:
    from flashtrain.kernels.fp8_quant import fp8_quantize
    for D in (128, 64, 256):
        for N in (4096, 16384):
            B, H = 16384 // N, 2048 // D
            q, k, v = rnd(B, H, N, D)
            for causal in (False, True):
                with torch.no_grad():
                    ms16 = do_bench(lambda: flash_attention(q, k, v, causal=causal), warmup=50, rep=200,
                                    return_mode="median")
                    log(sec="fp8fwd", what="bf16 flash", D=D, N=N, causal=causal, ms=ms16,
                        tf=tf(B, H, N, D, causal, ms16))
                    default_fwd = dict(configs.FP8_FWD)
                    for cfg in (FP8_FWD_SWEEP if D == 128 else FP8_FWD_SWEEP[:3]):
                        configs.FP8_FWD = {dim: cfg for dim in default_fwd}
                        try:
                            for had in ((True, False) if cfg == FP8_FWD_SWEEP[0] else (True,)):
                                ms = do_bench(lambda: flash_attention(q, k, v, causal=causal, fp8="forward",
                                                                      hadamard=had),
                                              warmup=50, rep=200, return_mode="median")
                                log(sec="fp8fwd", what=f"fp8 {cfg} hadamard={had}", D=D, N=N, causal=causal,
                                    ms=ms, tf=tf(B, H, N, D, causal, ms), x_bf16=round(ms16 / ms, 3))
                        except Exception as e:  # noqa: BLE001
                            log(sec="fp8fwd", what=f"fp8 {cfg}", D=D, N=N, causal=causal,
                                error=repr(e)[:300])
                    configs.FP8_FWD = default_fwd
                    ms = do_bench(lambda: fp8_quantize(q, 128), warmup=20, rep=100, return_mode="median")
                    log(sec="fp8fwd", what="quantize one tensor", D=D, N=N, ms=ms)
            del q, k, v

# (dK/dV, dQ) launch configs (BLOCK_M, BLOCK_N, warps, stages), each tile dividing the 128-row scale tiles
FP8_BWD_SWEEP = [((64, 128, 8, 3), (64, 64, 4, 3)), ((64, 128, 8, 2), (128, 128, 8, 2)),
                 ((32, 128, 8, 3), (64, 64, 4, 2)), ((64, 64, 4, 2), (128, 64, 8, 2))]
FP8_BWD_SEQS = [int(n) for n in os.environ.get("FP8_BWD_SEQS", "4096 16384").split()]
if "fp8bwd" in section:
    for D in (128, 64):
        for N in FP8_BWD_SEQS:
            B, H = 16384 // N, 2048 // D
            q, k, v = rnd(B, H, N, D, grad=True)
            dout = torch.randn_like(q)
            default_bwd = configs.FP8_BWD_DKDV[D], configs.FP8_BWD_DQ[D]
            for causal in (False, True):
                out = flash_attention(q, k, v, causal=causal)
                ms16 = do_bench(lambda: out.backward(dout, retain_graph=True), warmup=50, rep=200,
                                grad_to_none=[q, k, v], return_mode="median")
                log(sec="fp8bwd", what="bf16 flash bwd", D=D, N=N, causal=causal, ms=ms16,
                    tf=tf(B, H, N, D, causal, ms16, bwd=True))
                for cfg in FP8_BWD_SWEEP:
                    configs.FP8_BWD_DKDV[D], configs.FP8_BWD_DQ[D] = cfg
                    try:
                        out8 = flash_attention(q, k, v, causal=causal, fp8="full")
                        ms = do_bench(lambda: out8.backward(dout, retain_graph=True), warmup=50, rep=200,
                                      grad_to_none=[q, k, v], return_mode="median")
                        log(sec="fp8bwd", what=f"fp8 full bwd {cfg}", D=D, N=N, causal=causal, ms=ms,
                            tf=tf(B, H, N, D, causal, ms, bwd=True), x_bf16=round(ms16 / ms, 3))
                    except Exception as e:  # noqa: BLE001
                        log(sec="fp8bwd", what=f"fp8 full bwd {cfg}", D=D, N=N, causal=causal, error=repr(e)[:300])
                configs.FP8_BWD_DKDV[D], configs.FP8_BWD_DQ[D] = default_bwd
            del q, k, v

if "fp8acc" in section:
    # How precisely do FP8 tl.dot products accumulate on this GPU? Triton's default on sm_90 leaves the sum to
    # the tensor core's own accumulator (max_num_imprecise_acc = 2**30); 32 promotes to fp32 every 32 products.
    import triton.language as tl

    @triton.jit
    def _fp8_dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
                        PRECISE: tl.constexpr):
        a = tl.load(a_ptr + tl.arange(0, M)[:, None] * K + tl.arange(0, K)[None, :])
        b = tl.load(b_ptr + tl.arange(0, K)[:, None] + tl.arange(0, N)[None, :] * K)  # K-major
        if PRECISE:
            c = tl.dot(a, b, max_num_imprecise_acc=32)
        else:
            c = tl.dot(a, b)
        tl.store(c_ptr + tl.arange(0, M)[:, None] * N + tl.arange(0, N)[None, :], c)

    for K in (64, 128):
        a = (torch.randn(128, K, device="cuda") * 4).to(torch.float8_e4m3fn)
        b = (torch.randn(128, K, device="cuda") * 4).to(torch.float8_e4m3fn)
        exact = a.double() @ b.double().T
        for precise in (False, True):
            c = torch.empty(128, 128, device="cuda")
            _fp8_dot_kernel[(1,)](a, b, c, 128, 128, K, precise, num_warps=4)
            err = ((c.double() - exact).abs() / exact.abs().clamp_min(1e-3))
            log(sec="fp8acc", what=f"fp8 dot K={K} precise={precise}",
                rel_err_median=float(err.median()), rel_err_max=float(err.max()),
                rms_rel=float((c.double() - exact).norm() / exact.norm()))

if "profile16k" in section:
    # where a training step's time goes: gpt2-small (byte vocabulary), B=2 x 16k tokens, bf16 autocast, AdamW
    from torch.profiler import ProfilerActivity, profile

    from flashtrain import attention_backends
    from flashtrain.model import GPT, GPTConfig
    for attn in ("flash", "sdpa"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(seq_len=16384), attention_backends.get(attn)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        idx = torch.randint(0, 256, (2, 16385), device="cuda")

        def step():
            with torch.autocast("cuda", torch.bfloat16):
                _, loss = model(idx[:, :-1], idx[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(3):
            step()
        ms = do_bench(step, warmup=50, rep=500)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
        with open(f"{OUT}/profile_16k_{attn}.txt", "w") as fh:
            fh.write(table)
        log(sec="profile16k", what=attn, ms=round(ms, 2), tokens_per_s=round(2 * 16384 / ms * 1e3))
        del model, opt
        torch.cuda.empty_cache()

if "bwdtiles" in section:
    # each kernel's tile candidates (forced), the other backward kernel at its former default
    from flashtrain.kernels.attention_bwd import attention_bwd
    from flashtrain.kernels.attention_fwd import attention_fwd
    base = {"dkdv": triton.Config({"BLOCK_M": 32, "BLOCK_N": 64}, num_warps=4, num_stages=2),
            "dq": triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=2)}
    tiles = {
        "fwd": [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 4), (128, 32, 4, 3),
                (64, 64, 4, 3), (128, 128, 4, 2), (256, 64, 8, 2)],
        "dkdv": [(32, 64, 4, 2), (32, 64, 4, 3), (32, 64, 4, 4), (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 2),
                 (32, 128, 4, 2), (32, 128, 4, 3), (32, 128, 8, 2), (64, 128, 8, 2), (64, 128, 8, 3), (128, 128, 8, 2),
                 (16, 64, 4, 3), (64, 128, 4, 2), (128, 64, 4, 2)],
        "dq": [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 3), (128, 64, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3),
               (128, 128, 8, 2), (64, 32, 4, 3), (128, 32, 8, 3), (64, 128, 4, 2), (256, 64, 8, 2)],
    }
    for B, H in ((2, 12), (1, 32)):
        N, D, causal = 16384, 64, True
        q, k, v = rnd(B, H, N, D)
        do = torch.randn_like(q)
        out, lse = attention_fwd(q, k, v, causal, D ** -0.5)
        for kernel, candidates in tiles.items():
            for m, n, w, st in candidates:
                cfg = triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st)
                if kernel == "fwd":
                    with configs.forced_configs(fwd=cfg):
                        ms = do_bench(lambda: attention_fwd(q, k, v, causal, D ** -0.5), warmup=100, rep=300)
                else:
                    with configs.forced_configs(**{**base, kernel: cfg}):
                        ms = do_bench(lambda: attention_bwd(do, q, k, v, out, lse, None, causal, D ** -0.5),
                                      warmup=100, rep=300)
                log(sec="bwdtiles", what=f"{kernel} {(m, n, w, st)} B{B} H{H}", D=D, N=N, causal=causal,
                    ms=round(ms, 4), tf=tf(B, H, N, D, causal, ms, bwd=kernel != "fwd"))
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
            ms_f = do_bench(lambda: F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal), warmup=100, rep=300)
            ms_b = do_bench(lambda: torch.autograd.grad(o, (qq, kk, vv), do, retain_graph=True), warmup=100, rep=300)
        log(sec="bwdtiles", what=f"cudnn fwd B{B} H{H}", D=D, N=N, causal=causal, ms=round(ms_f, 4),
            tf=tf(B, H, N, D, causal, ms_f))
        log(sec="bwdtiles", what=f"cudnn bwd B{B} H{H}", D=D, N=N, causal=causal, ms=round(ms_b, 4),
            tf=tf(B, H, N, D, causal, ms_b, bwd=True))

if "launches" in section:
    # twenty-seventh session: each kernel's GPU time in one forward + backward (torch.profiler, 10 steps after 20),
    # bf16 and both FP8 modes at (4, 16, 4096, 128), causal and not; autograd.grad, so no .grad accumulates
    from torch.profiler import ProfilerActivity, profile
    torch.manual_seed(0)
    for causal in (True, False):
        q, k, v = rnd(4, 16, 4096, 128, grad=True)
        dout = torch.randn_like(q)
        for fp8 in (None, "forward", "full"):
            def step():
                torch.autograd.grad(flash_attention(q, k, v, causal=causal, fp8=fp8), (q, k, v), dout)

            for _ in range(20):
                step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    step()
                torch.cuda.synchronize()
            total = 0.0
            for e in sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total):
                if e.self_device_time_total > 0:
                    total += e.self_device_time_total / 10
                    log(sec="launches", what=f"fp8={fp8} {e.key[:100]}", D=128, N=4096, causal=causal,
                        calls=e.count // 10, us_per_step=round(e.self_device_time_total / 10, 1))
            log(sec="launches", what=f"fp8={fp8} total", D=128, N=4096, causal=causal, us_per_step=round(total, 1))

if "bwdsections" in section:  # thirty-fourth session: the causal backwards' blocks in launch sections
    # the op's backward (do_bench median: milliseconds, so the host's time per call hides behind the GPU's), head
    # by head (a section a pair) against the rule, and the rule with a section's rows in 2 and 32 MiB
    points = [("bf16", 4, 16, 4096, 128), ("bf16", 1, 16, 16384, 128), ("bf16", 2, 16, 8192, 128),
              ("bf16", 4, 8, 4096, 256), ("bf16", 1, 8, 16384, 256), ("bf16", 4, 32, 4096, 64),
              ("bf16", 1, 32, 16384, 64), ("bf16", 8, 12, 4096, 64),
              ("full", 4, 16, 4096, 128), ("full", 1, 16, 16384, 128), ("full", 4, 8, 4096, 256),
              ("full", 1, 8, 16384, 256)]
    variants = [("head by head", 1 << 20, 8 << 20), ("rule", None, 8 << 20), ("rule 2 MiB", None, 2 << 20),
                ("rule 32 MiB", None, 32 << 20)]
    for rnd_ in range(2):
        for mode, B, H, N, D in points:
            q, k, v = rnd(B, H, N, D, grad=True)
            dout = torch.randn_like(q)
            out = flash_attention(q, k, v, causal=True, fp8=None if mode == "bf16" else "full")
            for name, count, kv_bytes in variants:
                configs.CAUSAL_SECTIONS, configs.CAUSAL_SECTION_KV_BYTES = count, kv_bytes
                ms = do_bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), warmup=50,
                              rep=200, return_mode="median")
                log(sec="bwdsections", what=f"{mode} bwd {name} round {rnd_}", D=D, N=N, B=B, H=H, causal=True,
                    ms=round(ms, 4), tf=tf(B, H, N, D, True, ms, bwd=True))
            del q, k, v, dout, out
    configs.CAUSAL_SECTIONS, configs.CAUSAL_SECTION_KV_BYTES = None, 8 << 20

if "power" in section:  # fortieth session: the forward's GPU time against the SM clock under the 700 W cap
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
    from bench_attention import capture_graph, replay_us

    def timed(graph, calls=10):
        """Median and min us a call over 20 replays, with the SM clock (MHz) and power (W) read after each."""
        clocks, watts = [], []

        def read_clock_and_power():
            clocks.append(torch.cuda.clock_rate())
            watts.append(torch.cuda.power_draw() / 1000)

        times = sorted(replay_us(graph, calls, 20, after_each=read_clock_and_power))
        return dict(us=round(times[len(times) // 2], 1), us_min=round(times[0], 1),
                    mhz=f"{min(clocks)}-{max(clocks)}", watts=round(max(watts)))

    for B, H, N, D in ((4, 16, 4096, 128), (4, 8, 4096, 256)):
        q, k, v = rnd(B, H, N, D)
        for fp8 in (None, "forward"):
            graph = capture_graph(lambda: flash_attention(q, k, v, causal=True, fp8=fp8), 10)
            time.sleep(2)
            log(sec="power", what=f"fp8={fp8} after 2 s idle", D=D, N=N, B=B, H=H, causal=True, **timed(graph))
            end_load = time.time() + 3
            while time.time() < end_load:
                graph.replay()
            log(sec="power", what=f"fp8={fp8} after 3 s of replays", D=D, N=N, B=B, H=H, causal=True,
                **timed(graph))
            del graph

with open(f"{OUT}/diag1.json", "w") as fh:
    json.dump(rows, fh, indent=1)
print("\n=== summary ===")
for r in rows:
    print(r.get("sec"), r.get("what"), r.get("D"), r.get("N"), r.get("causal"), r.get("ms"), r.get("tf"),
          r.get("x_bf16"), r.get("us_per_call"), r.get("us_per_step", ""), r.get("error", ""))
