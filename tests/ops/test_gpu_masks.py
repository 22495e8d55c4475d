"""GPU checks of windows and packed sequences: bf16, error against float64 within 2x PyTorch's flash kernel on the
same data, and every tuning candidate. Skipped on machines without CUDA (see conftest.py)."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtrain import flash_attention, flash_attention_varlen
from flashtrain.kernels import tuning
from flashtrain.kernels.attention import tiles as attention_tiles
from flashtrain.ops.reference import attention_ref, attention_varlen_ref
from flashtrain.testing import TOLERANCE, assert_close, rel_error

from .test_gpu import MOST_CANDIDATES, _candidate
from .test_varlen import offsets

pytestmark = pytest.mark.gpu


def grads_of(fn, tensors, dout):
    tensors = [t.detach().requires_grad_() for t in tensors]
    out = fn(*tensors)
    return (out, *torch.autograd.grad(out, tensors, dout))


def packed(lengths, heads_q, heads_kv, head_dim, dtype, seed=0):
    torch.manual_seed(seed)
    total = sum(lengths)
    q = torch.randn(total, heads_q, head_dim, device="cuda", dtype=dtype)
    k, v = (torch.randn(total, heads_kv, head_dim, device="cuda", dtype=dtype) for _ in range(2))
    return q, k, v, offsets(lengths, "cuda")


@pytest.mark.parametrize("head_dim", [64, 128])
def test_documents_error_at_most_twice_sdpa_flash(head_dim):
    """Packed documents: error against float64 of output and gradients <= 2x SDPA flash run document by document."""
    lengths = [700, 1, 1500, 333, 1024]
    q, k, v, cu = packed(lengths, 4, 2, head_dim, torch.bfloat16)
    dout = torch.randn_like(q)
    ours = grads_of(lambda q, k, v: flash_attention_varlen(q, k, v, cu, cu, 1500, 1500, causal=True), (q, k, v), dout)

    def sdpa_flash(q, k, v):
        outs = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                outs.append(F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)),
                                                           is_causal=True, enable_gqa=True)[0].transpose(0, 1))
        return torch.cat(outs)

    theirs = grads_of(sdpa_flash, (q, k, v), dout)
    ref = grads_of(lambda q, k, v: attention_varlen_ref(q, k, v, cu, cu, causal=True, upcast=False)[0],
                   (q.double(), k.double(), v.double()), dout.double())
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), ours, theirs, ref):
        assert torch.isfinite(a).all(), f"{name}: NaN/inf"
        assert rel_error(a, r) <= 2 * rel_error(b, r), f"{name}: {rel_error(a, r):.3e} vs {rel_error(b, r):.3e}"


@pytest.mark.parametrize("window", [(256, 0), (100, 37)], ids=str)
def test_window_error_at_most_twice_torch_flash(window):
    """Sliding window: error <= 2x that of PyTorch's varlen flash kernel with the same window (where this torch has
    one), else within the bf16 tolerance."""
    seq, head_dim = 2048, 128
    q, k, v, cu = packed([seq], 4, 4, head_dim, torch.bfloat16)
    dout = torch.randn_like(q)
    ours = grads_of(lambda q, k, v: flash_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)),
                                                    window_size=window)[0].transpose(0, 1), (q, k, v), dout)
    ref = grads_of(lambda q, k, v: attention_ref(*(t.transpose(0, 1)[None] for t in (q, k, v)), window_size=window,
                                                 upcast=False)[0][0].transpose(0, 1),
                   (q.double(), k.double(), v.double()), dout.double())
    try:
        from torch.nn.attention.varlen import varlen_attn
        theirs = grads_of(lambda q, k, v: varlen_attn(q, k, v, cu, cu, seq, seq, window_size=window), (q, k, v), dout)
    except (ImportError, TypeError):
        theirs = None
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        if theirs is not None:
            assert rel_error(ours[i], ref[i]) <= 2 * rel_error(theirs[i], ref[i]), name
        else:
            assert_close(name, ours[i], ref[i].to(ours[i].dtype), TOLERANCE[torch.bfloat16][min(i, 1)])


@pytest.mark.parametrize("lengths", [[1, 300, 0, 129], [4096]], ids=str)
@pytest.mark.parametrize("window", [(-1, -1), (64, -1)], ids=str)
def test_bf16_varlen_odd_shapes(lengths, window):
    q, k, v, cu = packed(lengths, 8, 2, 40, torch.bfloat16)
    dout = torch.randn_like(q)
    longest = max(lengths)
    ours = grads_of(lambda q, k, v: flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=True,
                                                           window_size=window), (q, k, v), dout)
    ref = grads_of(lambda q, k, v: attention_varlen_ref(q, k, v, cu, cu, causal=True, window_size=window)[0],
                   (q, k, v), dout)
    out_tol, grad_tol = TOLERANCE[torch.bfloat16]
    for name, a, r in zip(("out", "dq", "dk", "dv"), ours, ref):
        assert_close(name, a, r.to(a.dtype), out_tol if name == "out" else grad_tol)


@pytest.mark.parametrize("index", range(MOST_CANDIDATES))
def test_every_tuning_candidate_with_windows_and_packing(index):
    """The windowed and packed variants are right under every tile the autotuner may pick."""
    lengths_q, lengths_k = [37, 0, 300, 129], [50, 3, 300, 100]
    torch.manual_seed(index)
    q = torch.randn(sum(lengths_q) + 5, 4, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(sum(lengths_k), 2, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    cu_q, cu_k = offsets(lengths_q, "cuda"), offsets(lengths_k, "cuda")
    dout = torch.randn_like(q)
    with tuning.forced_configs(fwd=_candidate(attention_tiles.FWD_CANDIDATES, index),
                               dkdv=_candidate(attention_tiles.DKDV_CANDIDATES, index),
                               dq=_candidate(attention_tiles.DQ_CANDIDATES, index)):
        ours = grads_of(lambda q, k, v: flash_attention_varlen(q, k, v, cu_q, cu_k, 300, 300, causal=True,
                                                               window_size=(70, -1)), (q, k, v), dout)
        dense = grads_of(lambda q, k, v: flash_attention(q, k, v, window_size=(33, 9)),
                         (q[:300].transpose(0, 1)[None], k[:300].transpose(0, 1)[None],
                          v[:300].transpose(0, 1)[None]), dout[:300].transpose(0, 1)[None])
    ref = grads_of(lambda q, k, v: attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True, window_size=(70, -1))[0],
                   (q, k, v), dout)
    ref_dense = grads_of(lambda q, k, v: attention_ref(q, k, v, window_size=(33, 9))[0],
                         (q[:300].transpose(0, 1)[None], k[:300].transpose(0, 1)[None],
                          v[:300].transpose(0, 1)[None]), dout[:300].transpose(0, 1)[None])
    out_tol, grad_tol = TOLERANCE[torch.float16]
    for name, a, r in [*zip(("out", "dq", "dk", "dv"), ours, ref), *zip(("w out", "w dq", "w dk", "w dv"), dense,
                                                                        ref_dense)]:
        assert_close(name, a, r.to(a.dtype), out_tol if "out" in name else grad_tol)


def test_fp64_varlen_is_exact():
    q, k, v, cu = packed([77, 1, 200], 4, 1, 72, torch.float64)
    dout = torch.randn_like(q)
    ours = grads_of(lambda q, k, v: flash_attention_varlen(q, k, v, cu, cu, 200, 200, causal=True,
                                                           window_size=(50, 3)), (q, k, v), dout)
    ref = grads_of(lambda q, k, v: attention_varlen_ref(q, k, v, cu, cu, causal=True, window_size=(50, 3))[0],
                   (q, k, v), dout)
    for name, a, r in zip(("out", "dq", "dk", "dv"), ours, ref):
        assert_close(name, a, r, 1e-12)
