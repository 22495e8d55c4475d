"""Compile every Triton kernel of flashtrain for an NVIDIA GPU target, on any machine (no GPU needed): the
Triton kernels, and for sm_90 the Gluon ones (the Hopper forward and backward).

Triton compiles ahead of time for a named target (``GPUTarget("cuda", 90, 32)``: Hopper), so a kernel that
would fail to compile on the GPU (a non-constexpr global, an unsupported FP8 layout, a type error) fails
here, before device time is spent. Each kernel is compiled for every launch configuration the autotuner or
the launchers may pick, and for each compile-time variant (causal, key bias, dropout, the FP8 kernels).
Correctness and speed still need the GPU. Must run *without* TRITON_INTERPRET (the interpreter replaces the
kernels by Python functions).

    python scripts/dev/compile_kernels.py            # Hopper (sm_90), every candidate (a few minutes)
    python scripts/dev/compile_kernels.py --quick    # one candidate per kernel: what the test suite runs
    python scripts/dev/compile_kernels.py --arch 100 # another target
    python scripts/dev/compile_kernels.py --only "fp8 dkdv" --wgmma-warnings  # and ptxas's wgmma serialisation warnings
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("scripts/dev/compile_kernels.py: unset TRITON_INTERPRET (the interpreter does not compile kernels)")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from flashtrain.kernels.attention import tiles as attention_tiles  # noqa: E402

from flashtrain.kernels.fp8 import tiles as fp8_tiles  # noqa: E402

from flashtrain.kernels.hopper import tiles as hopper_tiles  # noqa: E402
from flashtrain.kernels.attention.bwd import (attention_bwd_dkdv_kernel, attention_bwd_dq_kernel,  # noqa: E402
                                              attention_bwd_preprocess_kernel)
from flashtrain.kernels.fp8.bwd import (attention_fp8_bwd_dkdv_kernel,  # noqa: E402
                                                  attention_fp8_bwd_dq_kernel, fp8_bwd_quantize_do_kernel)
from flashtrain.kernels.fp8.fwd import attention_fp8_fwd_kernel, fp8_scores_in_f16  # noqa: E402
from flashtrain.kernels.attention.fwd import attention_fwd_kernel  # noqa: E402
from flashtrain.kernels.fp8.centring import SEQ_MEAN_BLOCK_D, SEQ_MEAN_BLOCK_N, centre_kernel, seq_mean_kernel  # noqa: E402
from flashtrain.kernels.attention.dropout_mask import dropout_keep_mask_kernel  # noqa: E402
from flashtrain.kernels.fp8 import quant as fp8_quant  # noqa: E402
from flashtrain.kernels.fp8.quant import fp8_dequantize_kernel, fp8_quantize_kernel  # noqa: E402
from flashtrain.kernels.fp8.hadamard import HADAMARD_BLOCK_R, hadamard_kernel  # noqa: E402

FLOAT_ARGS = {"qk_scale", "qk_scale_lo", "sm_scale", "sm_scale_lo", "dropout_p", "keep_scale", "keep_scale_lo",
              "norm", "norm_lo"}


DIVISIBLE_16 = [["tt.divisibility", 16]]


def specialization(kernel, pointers: dict, constexprs: dict) -> tuple[dict, dict]:
    """What Triton's launcher would specialise on for a typical aligned launch (contiguous bf16 tensors, head
    dims and sequence lengths multiples of 16): pointers and the other strides and lengths divisible by 16,
    the unit last-dim strides folded to the constant 1; nothing for the kernel's ``do_not_specialize``
    arguments. Without this the compiler cannot prove alignment and does not pipeline the loads (no
    cp.async), so register and shared-memory figures would be off.
    Returns (attrs, extra constants)."""
    attrs, ones = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs or name in kernel.do_not_specialize:
            continue
        if name in pointers:
            attrs[(i,)] = DIVISIBLE_16
        elif name.startswith("stride_") and name.endswith("d") and not name.endswith("_b"):
            ones[name] = 1
        elif name.startswith(("stride_", "seq_")) or name in ("n_rows", "d_in", "d_out"):
            attrs[(i,)] = DIVISIBLE_16
    return attrs, ones


def signature(kernel, pointers: dict, constexprs: dict) -> dict:
    """Triton signature: the given pointer types, fp32 for the float scalars, i32 for every other runtime
    argument (strides, lengths, seeds), 'constexpr' for the compile-time ones."""
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        else:
            sig[name] = "fp32" if name in FLOAT_ARGS else "i32"
    return sig


def compile_one(kernel, pointers, constexprs, target, num_warps=4, num_stages=2):
    # compile-time parameters with a default take it unless given (the signature would call them i32)
    defaults = {p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}
    attrs, ones = specialization(kernel, pointers, constexprs)
    constexprs = {**defaults, **constexprs, **ones}
    source = ASTSource
    if getattr(kernel, "is_gluon", lambda: False)():  # the Hopper kernels, in Gluon
        from triton.experimental.gluon._runtime import GluonASTSource
        source = GluonASTSource
    src = source(fn=kernel, signature=signature(kernel, pointers, constexprs), constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=target, options=dict(num_warps=num_warps, num_stages=num_stages))


def attention_jobs(dtype="bf16", quick=False, target_arch=90):
    """(name, kernel, pointers, constexprs, num_warps, num_stages) for the 16-bit kernels; ``quick``: only the
    first candidate of each list; ``target_arch`` 90 adds the Hopper forward and backward."""
    io = f"*{dtype}"
    common_ptr = {"Q": io, "K": io, "V": io, "O": io, "DO": io, "DQ": io, "DK": io, "DV": io, "LSE": "*fp32",
                  "DELTA": "*fp32", "KB": "*fp32", "DLSE": "*fp32", "CU_Q": "*i32", "CU_K": "*i32"}
    kinds = [("fwd", attention_fwd_kernel, attention_tiles.FWD_CANDIDATES, attention_tiles.FWD_CANDIDATES_WIDE),
             ("dkdv", attention_bwd_dkdv_kernel, attention_tiles.DKDV_CANDIDATES, attention_tiles.DKDV_CANDIDATES_WIDE),
             ("dkdv split dK", attention_bwd_dkdv_kernel, attention_tiles.DKDV_CANDIDATES,
              attention_tiles.DKDV_SPLIT_CANDIDATES_WIDE),
             ("dkdv split dV", attention_bwd_dkdv_kernel, attention_tiles.DKDV_CANDIDATES,
              attention_tiles.DKDV_SPLIT_CANDIDATES_WIDE),
             ("dq", attention_bwd_dq_kernel, attention_tiles.DQ_CANDIDATES, attention_tiles.DQ_CANDIDATES_WIDE)]
    dense = dict(LOCAL=False, VARLEN=False)
    variants = [dict(CAUSAL=True, HAS_KEY_BIAS=False, DROPOUT=False, **dense),
                dict(CAUSAL=False, HAS_KEY_BIAS=False, DROPOUT=False, **dense),
                dict(CAUSAL=True, HAS_KEY_BIAS=True, DROPOUT=True, **dense),
                dict(CAUSAL=True, HAS_KEY_BIAS=False, DROPOUT=False, LOCAL=True, VARLEN=True)]
    for name, kernel, narrow, wide in kinds:
        for head_dim, candidates in ((128, narrow), (256, wide)):
            for cfg in candidates[:1] if quick else candidates:
                for variant in variants:
                    meta = dict(GROUP=1, HEAD_DIM=head_dim, BLOCK_D=head_dim, PRECISION="ieee", **variant,
                                **cfg.kwargs)
                    if name == "fwd":
                        meta["SCALE_EARLY"] = variant["HAS_KEY_BIAS"]
                    if name.startswith("dkdv"):  # both load forms: masked rows (ragged seq_q) and EVEN_M
                        meta["EVEN_M"] = variant["CAUSAL"] and not variant["VARLEN"]
                    if name.startswith("dkdv split"):  # one of the two launches (dispatch.split_dkdv)
                        meta.update(WANT_DK=name.endswith("dK"), WANT_DV=name.endswith("dV"))
                    yield (f"{name} D={head_dim} {cfg.kwargs} w{cfg.num_warps} s{cfg.num_stages} {variant}",
                           kernel, common_ptr, meta, cfg.num_warps, cfg.num_stages)
    if target_arch == 90:  # the warp-specialised forward: sm_90 only (wgmma, setmaxnreg)
        from flashtrain.kernels.hopper.fwd import attention_fwd_hopper_kernel
        for head_dim in hopper_tiles.HOPPER_FWD_CONFIGS:
            for causal in (False, True):
                meta = dict(GROUP=1, HEAD_DIM=head_dim, CAUSAL=causal, **hopper_tiles.hopper_fwd_meta(head_dim, causal))
                yield (f"fwd hopper D={head_dim} causal={causal}", attention_fwd_hopper_kernel, common_ptr, meta, 4, 2)
        from flashtrain.kernels.hopper.bwd import attention_bwd_hopper_dq_kernel, attention_bwd_hopper_kernel
        for head_dim in hopper_tiles.HOPPER_BWD_CONFIGS:  # the five-matmul backward and its dQ conversion
            for causal in (False, True):
                meta = dict(HEAD_DIM=head_dim, CAUSAL=causal, **hopper_tiles.hopper_bwd_meta(head_dim))
                yield (f"bwd hopper D={head_dim} causal={causal}", attention_bwd_hopper_kernel,
                       {**common_ptr, "DQ": "*fp32"}, meta, 4, 2)
            yield (f"bwd hopper dQ D={head_dim}", attention_bwd_hopper_dq_kernel, {"DQ_ACC": "*fp32", "DQ": io},
                   dict(HEAD_DIM=head_dim, BLOCK_M=64), 4, 2)
    for zero in (False, True):  # with the Hopper backward's dQ buffer zeroed on the way, and without
        yield (f"bwd preprocess zero_dq_acc={zero}", attention_bwd_preprocess_kernel,
               {**common_ptr, "DQ_ACC": "*fp32"}, dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_M=64, HAS_DLSE=True,
                                                       ZERO_DQ_ACC=zero), 4, 2)
    yield ("dropout mask", dropout_keep_mask_kernel, {"KEEP": "*u8"}, dict(BLOCK_M=32, BLOCK_N=32), 4, 2)


def fp8_jobs(dtype="bf16", target_arch=90):
    """As attention_jobs for the FP8 path; ``target_arch`` 90 adds the FP8 Hopper forward."""
    fp8 = "*fp8e4nv"
    if target_arch == 90:  # sm_90 only (wgmma, setmaxnreg)
        from flashtrain.kernels.hopper.fp8_fwd import attention_fp8_fwd_hopper_kernel
    for head_dim in (64, 128, 256):
        fwd = fp8_tiles.fp8_config(1 << 20, head_dim)
        fwd_ptr = {"Q8": fp8, "K8": fp8, "VT8": fp8, "QS": "*fp32", "KS": "*fp32", "KS_MAX": "*fp32", "VS": "*fp32",
                   "O": f"*{dtype}", "LSE": "*fp32"}
        for causal in (False, True):
            yield (f"fp8 fwd D={head_dim} causal={causal}", attention_fp8_fwd_kernel, fwd_ptr,
                   dict(GROUP=1, QK_DIM=head_dim, HEAD_DIM=head_dim, BLOCK_DK=head_dim, BLOCK_DV=head_dim,
                        CAUSAL=causal, SCALE_EARLY=False, BLOCK_M=fwd["BLOCK_M"], BLOCK_N=fwd["BLOCK_N"]),
                   fwd["num_warps"], fwd["num_stages"])
            if target_arch == 90 and head_dim in hopper_tiles.FP8_HOPPER_FWD_CONFIGS:
                yield (f"fp8 fwd hopper D={head_dim} causal={causal}", attention_fp8_fwd_hopper_kernel, fwd_ptr,
                       dict(GROUP=1, QK_DIM=head_dim, HEAD_DIM=head_dim, KV_TILE=fwd["BLOCK_N"], CAUSAL=causal,
                            **hopper_tiles.fp8_hopper_fwd_meta(head_dim, causal)), 4, 2)
            bwd_ptr = {"Q8": fp8, "QT8": fp8, "K8": fp8, "KT8": fp8, "V8": fp8, "DO8": fp8, "DOT8": fp8,
                       "QS": "*fp32", "KS": "*fp32", "VS": "*fp32", "DOS": "*fp32", "DV_UNIT": "*fp32", "LSE": "*fp32",
                       "DELTA": "*fp32", "SIGNS": "*fp32", "DK_SUM": "*fp32",
                       "DK": "*fp32", "DV": f"*{dtype}", "DQ": f"*{dtype}"}  # dK in fp32: K smoothing centres it
            bwd = fp8_tiles.fp8_bwd_tiles(1 << 20, head_dim)
            for name, kernel in (("dkdv", attention_fp8_bwd_dkdv_kernel), ("dq", attention_fp8_bwd_dq_kernel)):
                launch = bwd[name]
                for even in (True, False):  # the unmasked stage and ragged shapes (every tile masked)
                    meta = dict(GROUP=1, QK_DIM=head_dim, HEAD_DIM=head_dim, BLOCK_DK=head_dim, BLOCK_DV=head_dim,
                                CAUSAL=causal, EVEN=even, SCALE_M=bwd["SCALE_M"],
                                SCALE_N=bwd["SCALE_N"], BLOCK_M=launch["BLOCK_M"], BLOCK_N=launch["BLOCK_N"],
                                ROTATED=True)  # the defaults: rotated, K smoothed
                    if name == "dkdv":
                        meta.update(SETTLE_DK=launch["SETTLE_DK"], KEY_SUMS=True)
                    yield (f"fp8 {name} D={head_dim} causal={causal} even={even}", kernel, bwd_ptr, meta,
                           launch["num_warps"], launch["num_stages"])
        quant_ptr = {"X": f"*{dtype}", "MEAN": "*fp32", "SIGNS": "*fp32", "H": f"*{dtype}", "Q": fp8, "QT": fp8,
                     "S": "*fp32"}

        def quantize_job(name, rotate, centre, zero=False, second=False, mma_key_order=False,
                         amax_to=fp8_quant.E4M3_MAX):
            launch = fp8_quant.quant_launch(128, head_dim, rotate, second_copy=second)
            warps, stages = launch.pop("num_warps"), launch.pop("num_stages")
            return (f"fp8 quantize D={head_dim}{name}", fp8_quantize_kernel, quant_ptr,
                    dict(HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_N=128, CENTRE=centre, ROTATE=rotate,
                         DOT_PRECISION="tf32", ZERO_SCALE_IF_EMPTY=zero, MMA_KEY_ORDER=mma_key_order,
                         SECOND_COPY=second, AMAX_TO=amax_to, **launch), warps, stages)

        # V, dO / K with smoothing / Q / K rotated and smoothed, each also with empty tiles' scale 0 (as the
        # backward's Q and dO) and with the transposed second copy (the backward's Q, K, dO); unrotated (128, 256)
        # tiles whole at 8 warps, in chunks with the second copy
        for rotate, centre, zero, second in itertools.product((False, True), repeat=4):
            yield quantize_job(f"{' centred' if centre else ''}{' rotated' if rotate else ''}"
                               f"{' zero-scale' if zero else ''}{' both layouts' if second else ''}",
                               rotate, centre, zero, second)
        for second in (False, True):  # the FP8 backward's dO pass with its delta (both layouts for 16-bit dO)
            yield (f"fp8 bwd dO and delta D={head_dim} both layouts={second}", fp8_bwd_quantize_do_kernel,
                   {"DO": f"*{dtype}", "O": f"*{dtype}", "DLSE": "*fp32", "Q": fp8, "QT": fp8, "S": "*fp32",
                    "DELTA": "*fp32"},
                   dict(HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_N=128, CHUNK=fp8_quant.quant_chunk(128, head_dim),
                        HAS_DLSE=False, SECOND_COPY=second), 4, 3)
        if fp8_scores_in_f16(head_dim):
            for centre in (False, True):  # Q and K for the FP8 Hopper forward's float16 scores
                yield quantize_job(f"{' centred' if centre else ''} rotated to {hopper_tiles.FP8_SCORES_AMAX}", True,
                                   centre, amax_to=hopper_tiles.FP8_SCORES_AMAX)
        yield quantize_job(" mma key order zero-scale", False, False, zero=True, mma_key_order=True)  # V, Hopper fwd
        yield (f"fp8 dequantize D={head_dim}", fp8_dequantize_kernel,  # fp8="forward"'s backward: Q and K
               {"Q": fp8, "S": "*fp32", "OUT": f"*{dtype}"},
               dict(HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_N=128,
                    ROWS=fp8_tiles.row_pass_rows(1 << 20, head_dim)), 4, 3)
        for source in ("*fp32", f"*{dtype}"):  # dK's centring: fp8="full"'s (fp32 dK), fp8="forward"'s
            yield (f"centre D={head_dim} from {source[1:]}", centre_kernel,
                   {"X": source, "MEAN": "*fp32", "Y": f"*{dtype}"},
                   dict(HEAD_DIM=head_dim, BLOCK_D=head_dim, ROWS=fp8_tiles.row_pass_rows(1 << 20, head_dim)), 4, 3)
        yield (f"seq mean D={head_dim}", seq_mean_kernel, {"X": f"*{dtype}", "MEAN": "*fp32"},  # K smoothing's mean
               dict(HEAD_DIM=head_dim, BLOCK_D=min(SEQ_MEAN_BLOCK_D, head_dim), BLOCK_N=SEQ_MEAN_BLOCK_N), 4, 3)
        # the forward transform (hadamard_transform), the inverse (dQ, dK back), the centred forward (tests) and
        # the centred inverse (fp8="forward"'s dK)
        for signs_first, centre in ((True, False), (False, False), (True, True), (False, True)):
            yield (f"hadamard D={head_dim} signs_first={signs_first} centre={centre}", hadamard_kernel,
                   {"X": f"*{dtype}", "SIGNS": "*fp32", "Y": f"*{dtype}", "MEAN": "*fp32"},
                   dict(D=head_dim, BLOCK_R=HADAMARD_BLOCK_R, SIGNS_FIRST=signs_first, CENTRE=centre), 4, 3)


def serialisation_warnings(compiled, arch: int) -> list[str]:
    """ptxas's performance warnings about wgmma (C7510-C7519: "wgmma.mma_async instructions are serialized ...",
    "warpgroup.wait is injected ...") for a compiled kernel's PTX, from ``ptxas -v`` run again on it (Triton
    does not show them). A serialised kernel waits for every wgmma before the next."""
    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        result = subprocess.run([get_ptxas(arch).path, "-v", f"-arch=sm_{arch}a", ptx, "-o", ptx + ".cubin"],
                                capture_output=True, text=True)
    return [line.strip() for line in result.stderr.splitlines() if re.search(r"\(C751\d\)", line)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x 10 (90: Hopper)")
    parser.add_argument("--only", default="", help="compile only the jobs whose name contains this")
    parser.add_argument("--quick", action="store_true", help="one tuning candidate per kernel and head dim")
    parser.add_argument("--wgmma-warnings", nargs="*", metavar="NAME", default=None,
                        help="also print ptxas's wgmma serialisation warnings (runs ptxas again) for the kernels "
                             "whose job name contains one of NAME (every kernel when none is given)")
    args = parser.parse_args(argv)
    target = GPUTarget("cuda", args.arch, 32)
    failures = 0
    jobs = [j for j in (*attention_jobs(quick=args.quick, target_arch=args.arch), *fp8_jobs(target_arch=args.arch))
            if args.only in j[0]]
    start = time.time()
    for name, kernel, pointers, meta, warps, stages in jobs:
        try:
            compiled = compile_one(kernel, pointers, meta, target, warps, stages)
        except Exception as exc:  # report every failure, not only the first
            failures += 1
            print(f"FAILED {name}: {type(exc).__name__}: {str(exc).splitlines()[-1] if str(exc) else ''}")
            continue
        if args.wgmma_warnings is not None and (not args.wgmma_warnings or any(w in name for w in args.wgmma_warnings)):
            for warning in serialisation_warnings(compiled, args.arch):
                print(f"WGMMA {name}: {warning}")
    print(f"{len(jobs) - failures}/{len(jobs)} kernels compiled for sm_{args.arch} in {time.time() - start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
