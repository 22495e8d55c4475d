"""Comparison helpers shared by the tests and the benchmarks' correctness checks."""

from __future__ import annotations

import torch

# Relative Frobenius error allowed against a float64 reference, per input dtype: (output, gradients).
# float64 and float32 are exact up to accumulation order; float16/bfloat16 round P and dS to the input
# dtype before the second matmul of each pair, as every FlashAttention does.
TOLERANCE = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1e-5, 1e-4),
    torch.float16: (3e-3, 1e-2),
    torch.bfloat16: (2e-2, 5e-2),
}


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64 (0 when both are 0)."""
    x, ref = x.double(), ref.double()
    denom = ref.norm().item()
    diff = (x - ref).norm().item()
    return diff / denom if denom > 0 else diff


def assert_close(name: str, x: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """x has no NaN/inf where ref is finite, -inf exactly where ref is -inf, and a relative error <= tol."""
    assert x.shape == ref.shape, f"{name}: shape {tuple(x.shape)} != reference {tuple(ref.shape)}"
    ref = ref.to(x.device)
    neg_inf = torch.isneginf(ref)
    assert torch.equal(torch.isneginf(x), neg_inf), f"{name}: -inf entries differ from the reference"
    finite = ~neg_inf
    assert torch.isfinite(x[finite]).all(), f"{name}: NaN or inf where the reference is finite"
    err = rel_error(x[finite], ref[finite])
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e}"



def assert_attention_close(pair, dtype: torch.dtype) -> None:
    """``pair`` = ((out, lse, (dq, dk, dv)), (ref, ref_lse, (ref_dq, ref_dk, ref_dv))): the kernels' output, LSE and
    gradients against a reference's, at ``dtype``'s TOLERANCE (the LSE float32, no looser than 1e-6)."""
    (out, lse, grads), (ref, ref_lse, ref_grads) = pair
    tol_out, tol_grad = TOLERANCE[dtype]
    assert out.shape == ref.shape and lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert_close("out", out, ref, tol_out)
    assert_close("lse", lse, ref_lse, max(tol_out, 1e-6))
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(name, g, r, tol_grad)

def outlier_data(shape, generator: torch.Generator, dtype=torch.float64) -> torch.Tensor:
    """FlashAttention-3's FP8 accuracy benchmark data: N(0, 1) with 0.1% of entries drawn from N(0, 100)."""
    x = torch.randn(shape, generator=generator, dtype=torch.float64)
    outliers = torch.rand(shape, generator=generator) < 1e-3
    return torch.where(outliers, torch.randn(shape, generator=generator, dtype=torch.float64) * 10, x).to(dtype)
