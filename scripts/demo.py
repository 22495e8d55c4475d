"""flash_attention, forward and backward, checked against PyTorch and timed, on whatever machine this is.

On a CUDA GPU: bf16 causal attention at 16k tokens (B=1, H=16, D=128) against SDPA and eager PyTorch:
time and extra memory of forward+backward, and the error of each against a float64 reference.
On a CPU-only machine: the same kernels through Triton's interpreter on a tiny problem (seconds).

    python scripts/demo.py [--seq N]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: CPU runs the interpreter

from flashtrain import flash_attention
from flashtrain.trainer import backends as attention_backends  # noqa: E402
from flashtrain.ops.reference import attention_ref  # noqa: E402
from flashtrain.testing import rel_error  # noqa: E402


def run(name, fn, q, k, v, dout):
    """(seconds, extra GiB, out, grads) of one forward+backward."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    if ON_GPU:
        fn(q, k, v).backward(dout)  # warm-up: compile / autotune outside the timing
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if ON_GPU else 0
    start = time.perf_counter()
    try:
        out = fn(q, k, v)
        out.backward(dout)
    except torch.OutOfMemoryError:
        return None
    if ON_GPU:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    extra = (torch.cuda.max_memory_allocated() - base) / 2**30 if ON_GPU else None
    return seconds, extra, out.detach(), (q.grad, k.grad, v.grad)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=16384 if ON_GPU else 129)
    args = parser.parse_args()
    device, dtype = ("cuda", torch.bfloat16) if ON_GPU else ("cpu", torch.float16)
    batch, heads, head_dim = (1, 16, 128) if ON_GPU else (1, 2, 40)
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(batch, heads, args.seq, head_dim, device=device, dtype=dtype) for _ in range(4))
    print(f"causal attention, {dtype}, B={batch} H={heads} N={args.seq} D={head_dim} on "
          f"{torch.cuda.get_device_name() if ON_GPU else 'CPU (Triton interpreter)'}")

    # float64 reference (on the GPU at 16k this holds a few 4 GiB matrices per head: do 2 heads)
    ref_heads = slice(0, 2)
    qr, kr, vr = (t[:, ref_heads].double().requires_grad_() for t in (q, k, v))
    ref_out = attention_ref(qr, kr, vr, causal=True)[0]
    ref_out.backward(dout[:, ref_heads].double())
    ref = (ref_out.detach(), qr.grad, kr.grad, vr.grad)

    providers = {"flashtrain": lambda q, k, v: flash_attention(q, k, v, causal=True)}
    if ON_GPU:
        providers["sdpa"] = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        providers["eager"] = attention_backends.eager  # the (N, N) matrix flash avoids
    print(f"{'provider':12s} {'fwd+bwd ms':>11s} {'extra GiB':>10s} {'err out':>9s} {'err dq':>9s} "
          f"{'err dk':>9s} {'err dv':>9s}   (relative to float64)")
    for name, fn in providers.items():
        result = run(name, fn, q, k, v, dout)
        if result is None:
            print(f"{name:12s} out of memory")
            continue
        seconds, extra, out, grads = result
        errs = [rel_error(x[:, ref_heads], r) for x, r in zip((out, *grads), ref)]
        memory = f"{extra:10.2f}" if ON_GPU else f"{'-':>10s}"
        print(f"{name:12s} {seconds * 1e3:11.1f} {memory} " + " ".join(f"{e:9.2e}" for e in errs))
        del out, grads
        if ON_GPU:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
