"""GPU-only checks: bf16, long sequences, error against SDPA's flash backend, fp64 exactness, every
launch config the autotuner may pick. Skipped on machines without CUDA (see conftest.py)."""

import importlib

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashtrain import flash_attention
from flashtrain.kernels.attention import tiles as attention_tiles
from flashtrain.ops import dispatch
from flashtrain.kernels.fp8 import tiles as fp8_tiles
from flashtrain.kernels.hopper import tiles as hopper_tiles
from flashtrain.kernels import masking
from flashtrain.kernels import tuning
from flashtrain.kernels.hopper.tiles import fp8_scores_in_f16
from flashtrain.kernels.launch import clear_kept
from flashtrain.ops.reference import attention_ref
from flashtrain.testing import TOLERANCE, assert_close, rel_error

pytestmark = pytest.mark.gpu


def randn(*shape, dtype):
    return torch.randn(*shape, device="cuda", dtype=dtype)


def outputs_and_grads(fn, q, k, v, dout):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


def assert_outputs_close(ours, ref, dtype):
    """(out, dq, dk, dv) against a reference's (cast to ours) at ``dtype``'s TOLERANCE."""
    out_tol, grad_tol = TOLERANCE[dtype]
    for name, a, r in zip(("out", "dq", "dk", "dv"), ours, ref):
        assert_close(name, a, r.to(a.dtype), out_tol if name == "out" else grad_tol)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype, seq, head_dim", [
    (torch.bfloat16, 1024, 64), (torch.bfloat16, 16384, 64), (torch.bfloat16, 4096, 128),
    (torch.bfloat16, 16384, 128), (torch.bfloat16, 2048, 256), (torch.bfloat16, 16384, 256),
    (torch.float16, 4096, 64), (torch.float16, 16384, 128),
], ids=str)
def test_error_at_most_twice_sdpa_flash(dtype, seq, head_dim, causal):
    """Error against a float64 reference, output and all gradients, <= 2x that of SDPA's flash backend."""
    torch.manual_seed(seq + head_dim)
    heads_q, heads_kv = 2, 1  # the float64 reference holds several (heads, seq, seq) matrices: 4 GiB each at 16k
    q = randn(1, heads_q, seq, head_dim, dtype=dtype)
    k, v = randn(1, heads_kv, seq, head_dim, dtype=dtype), randn(1, heads_kv, seq, head_dim, dtype=dtype)
    dout = randn(1, heads_q, seq, head_dim, dtype=dtype)

    ours = outputs_and_grads(lambda q, k, v: flash_attention(q, k, v, causal=causal), q, k, v, dout)

    def sdpa_flash(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    theirs = outputs_and_grads(sdpa_flash, q, k, v, dout)
    ref = outputs_and_grads(lambda q, k, v: attention_ref(q, k, v, causal=causal, upcast=False)[0],
                            q.double(), k.double(), v.double(), dout.double())
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), ours, theirs, ref):
        assert torch.isfinite(a).all(), f"{name}: NaN/inf"
        ours_err, sdpa_err = rel_error(a, r), rel_error(b, r)
        assert ours_err <= 2 * sdpa_err, f"{name}: error {ours_err:.3e} > 2 x SDPA flash's {sdpa_err:.3e}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 4, 2, 37, 129, 40), (1, 2, 1, 129, 37, 24), (1, 8, 2, 300, 300, 128),
                                   (1, 2, 2, 1, 1, 256)], ids=str)
def test_bf16_odd_shapes(shape, causal):
    batch, heads_q, heads_kv, seq_q, seq_k, head_dim = shape
    q = randn(batch, heads_q, seq_q, head_dim, dtype=torch.bfloat16).requires_grad_()
    k = randn(batch, heads_kv, seq_k, head_dim, dtype=torch.bfloat16).requires_grad_()
    v = randn(batch, heads_kv, seq_k, head_dim, dtype=torch.bfloat16).requires_grad_()
    dout = randn(batch, heads_q, seq_q, head_dim, dtype=torch.bfloat16)
    ours = outputs_and_grads(lambda q, k, v: flash_attention(q, k, v, causal=causal), q, k, v, dout)
    ref = outputs_and_grads(lambda q, k, v: attention_ref(q, k, v, causal=causal)[0], q, k, v, dout)
    assert_outputs_close(ours, ref, torch.bfloat16)


def test_fp64_is_exact():
    q = randn(2, 6, 300, 72, dtype=torch.float64).requires_grad_()
    k, v = (randn(2, 2, 257, 72, dtype=torch.float64).requires_grad_() for _ in range(2))
    dout = randn(2, 6, 300, 72, dtype=torch.float64)
    for causal in (False, True):
        ours = outputs_and_grads(lambda q, k, v: flash_attention(q, k, v, causal=causal), q, k, v, dout)
        ref = outputs_and_grads(lambda q, k, v: attention_ref(q, k, v, causal=causal)[0], q, k, v, dout)
        for name, a, r in zip(("out", "dq", "dk", "dv"), ours, ref):
            assert_close(name, a, r, 1e-12)
    small = [t.detach()[:1, :2, :19, :16].clone().requires_grad_() for t in (q, k, v)]
    small[1], small[2] = small[1][:, :1], small[2][:, :1]
    assert torch.autograd.gradcheck(lambda q, k, v: flash_attention(q, k, v, causal=True), small,
                                    fast_mode=True)


CANDIDATE_SETS = {  # head_dim -> the candidate lists the autotuner chooses from at that head_dim
    40: (attention_tiles.FWD_CANDIDATES, attention_tiles.DKDV_CANDIDATES, attention_tiles.DQ_CANDIDATES),
    256: (attention_tiles.FWD_CANDIDATES_WIDE, attention_tiles.DKDV_CANDIDATES_WIDE,
          attention_tiles.DQ_CANDIDATES_WIDE),
}


def _candidate(candidates, index):
    """The index-th candidate, cycling through shorter lists (the kernels' lists differ in length)."""
    return candidates[index % len(candidates)]


MOST_CANDIDATES = max(len(c) for lists in CANDIDATE_SETS.values() for c in lists)


@pytest.mark.parametrize("seq_q", [256, 257], ids=["whole_blocks", "ragged"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", sorted(CANDIDATE_SETS))
@pytest.mark.parametrize("index", range(MOST_CANDIDATES))
def test_every_tuning_candidate_is_exact(index, head_dim, causal, seq_q):
    """Whatever config the autotuner picks, the result is right: each candidate forced in turn, with seq_q a
    multiple of every BLOCK_M (the dK/dV kernel's unmasked loads) and not. dK and dV in one launch, which these
    lists tile (the split launch's list: ``test_every_split_dkdv_candidate_is_exact``)."""
    q = randn(2, 4, seq_q, head_dim, dtype=torch.float16).requires_grad_()
    k, v = (randn(2, 2, 300, head_dim, dtype=torch.float16).requires_grad_() for _ in range(2))
    dout = randn(2, 4, seq_q, head_dim, dtype=torch.float16)
    fwd, dkdv, dq = CANDIDATE_SETS[head_dim]
    with dispatch.split_dkdv("never"), tuning.forced_configs(fwd=_candidate(fwd, index), dkdv=_candidate(dkdv, index),
                                                             dq=_candidate(dq, index)):
        ours = outputs_and_grads(lambda q, k, v: flash_attention(q, k, v, causal=causal), q, k, v, dout)
    ref = outputs_and_grads(lambda q, k, v: attention_ref(q, k, v, causal=causal)[0], q, k, v, dout)
    assert_outputs_close(ours, ref, torch.float16)


@pytest.mark.parametrize("seq_q", [256, 257], ids=["whole_blocks", "ragged"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("index", range(len(attention_tiles.DKDV_SPLIT_CANDIDATES_WIDE)))
def test_every_split_dkdv_candidate_is_exact(index, causal, seq_q):
    """dK and dV in two launches (``dispatch.split_dkdv``) at head_dim 256, each of their candidates forced, GQA
    and seq_q != seq_k; and the tuner's own pick in bf16."""
    q = randn(2, 4, seq_q, 256, dtype=torch.float16).requires_grad_()
    k, v = (randn(2, 2, 300, 256, dtype=torch.float16).requires_grad_() for _ in range(2))
    dout = randn(2, 4, seq_q, 256, dtype=torch.float16)
    with dispatch.split_dkdv("always"), tuning.forced_configs(dkdv=attention_tiles.DKDV_SPLIT_CANDIDATES_WIDE[index]):
        ours = outputs_and_grads(lambda q, k, v: flash_attention(q, k, v, causal=causal), q, k, v, dout)
    ref = outputs_and_grads(lambda q, k, v: attention_ref(q, k, v, causal=causal)[0], q, k, v, dout)
    assert_outputs_close(ours, ref, torch.float16)
    if index == 0:
        q, k, v, dout = (t.detach().to(torch.bfloat16) for t in (q, k, v, dout))
        with dispatch.split_dkdv("always"):
            ours = outputs_and_grads(lambda q, k, v: flash_attention(q, k, v, causal=causal), q, k, v, dout)
        ref = outputs_and_grads(lambda q, k, v: attention_ref(q, k, v, causal=causal)[0], q, k, v, dout)
        assert_outputs_close(ours, ref, torch.bfloat16)


def test_split_dkdv_where_measured_faster():
    """The default ("auto") backward writes dK and dV in two launches from the head_dim measured faster on this
    architecture, and in one below it."""
    threshold = dispatch.SPLIT_DKDV_MIN_HEAD_DIM.get(dispatch.device_capability(torch.device("cuda")))
    for head_dim in (128, 256):
        q = randn(1, 2, 256, head_dim, dtype=torch.bfloat16)
        want = dispatch.TRITON_SPLIT if threshold is not None and head_dim >= threshold else dispatch.TRITON
        assert dispatch.backward(q, q, q, q, True, None, 0.0).kernel == want, (head_dim, threshold)


def test_launches_of_other_sizes_are_tuned_apart(monkeypatch):
    """One sequence bucket, two grid sizes (under one wave and eight waves of SMs): each kernel gets a pick per
    size, so a small launch's pick (in this process or in Triton's disk cache) never decides a large one's."""
    monkeypatch.setattr(tuning, "_picks", {})
    for batch, heads in ((1, 1), (16, 16)):
        q, k, v = (randn(batch, heads, 1024, 256, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
        flash_attention(q, k, v, causal=True).sum().backward()
    waves = {(key[0], key[2]) for key in tuning._picks}
    assert waves == {(name, bucket) for name in ("fwd", "dkdv", "dq") for bucket in (1, 8)}, tuning._picks.keys()


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bf16_key_padding_and_dropout(head_dim, causal):
    """bf16 with a key padding mask and dropout in the kernels, against float64 with the kernels' mask."""
    from flashtrain.ops.attention import SEED_BOUND
    from flashtrain.kernels import dropout_keep_mask

    torch.manual_seed(head_dim)
    batch, heads_q, heads_kv, seq, p = 2, 4, 2, 1000, 0.1
    q = randn(batch, heads_q, seq, head_dim, dtype=torch.bfloat16)
    k, v = (randn(batch, heads_kv, seq, head_dim, dtype=torch.bfloat16) for _ in range(2))
    dout = randn(batch, heads_q, seq, head_dim, dtype=torch.bfloat16)
    kpm = torch.rand(batch, seq, device="cuda") < 0.2
    kpm[1, 700:] = True
    torch.manual_seed(1)
    ours = outputs_and_grads(lambda q, k, v: flash_attention(q, k, v, causal=causal, key_padding_mask=kpm,
                                                             dropout_p=p), q, k, v, dout)
    torch.manual_seed(1)
    keep = dropout_keep_mask(int(torch.randint(SEED_BOUND, (), dtype=torch.int64)), batch, heads_q, seq, seq, p, "cuda")
    ref = outputs_and_grads(lambda q, k, v: attention_ref(q, k, v, causal=causal, key_padding_mask=kpm,
                                                          dropout_keep=keep, dropout_p=p)[0], q, k, v, dout)
    assert_outputs_close(ours, ref, torch.bfloat16)


@pytest.mark.parametrize("seq_q", [256, 257], ids=["whole_blocks", "ragged"])
@pytest.mark.parametrize("index", range(MOST_CANDIDATES))
def test_every_tuning_candidate_with_padding_and_dropout(index, seq_q):
    """The key-bias and dropout variants (more registers) compile and are right under every candidate."""
    from flashtrain.ops.attention import SEED_BOUND
    from flashtrain.kernels import dropout_keep_mask

    q = randn(2, 4, seq_q, 128, dtype=torch.float16)
    k, v = (randn(2, 2, 300, 128, dtype=torch.float16) for _ in range(2))
    dout = randn(2, 4, seq_q, 128, dtype=torch.float16)
    kpm = torch.rand(2, 300, device="cuda") < 0.3
    with tuning.forced_configs(fwd=_candidate(attention_tiles.FWD_CANDIDATES, index),
                                dkdv=_candidate(attention_tiles.DKDV_CANDIDATES, index),
                                dq=_candidate(attention_tiles.DQ_CANDIDATES, index)):
        torch.manual_seed(0)
        ours = outputs_and_grads(lambda q, k, v: flash_attention(q, k, v, causal=True, key_padding_mask=kpm,
                                                                 dropout_p=0.2), q, k, v, dout)
    torch.manual_seed(0)
    keep = dropout_keep_mask(int(torch.randint(SEED_BOUND, (), dtype=torch.int64)), 2, 4, seq_q, 300, 0.2, "cuda")
    ref = outputs_and_grads(lambda q, k, v: attention_ref(q, k, v, causal=True, key_padding_mask=kpm,
                                                          dropout_keep=keep, dropout_p=0.2)[0], q, k, v, dout)
    assert_outputs_close(ours, ref, torch.float16)


needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="the warp-specialised kernels (kernels/hopper/) run on sm_90 GPUs only")

HOPPER_MODULES = {"attention_fwd_hopper": "fwd", "attention_bwd_hopper": "bwd", "attention_fp8_fwd_hopper": "fp8_fwd"}


def hopper_launches(monkeypatch, kernel: str = "attention_fwd_hopper") -> list:
    """A list that grows by one per launch of a Hopper kernel: the launcher ``kernel`` of its module in
    kernels/hopper/ (attention_fwd_hopper, attention_bwd_hopper, attention_fp8_fwd_hopper)."""
    module = importlib.import_module(f"flashtrain.kernels.hopper.{HOPPER_MODULES[kernel]}")
    launches, real = [], getattr(module, kernel)
    monkeypatch.setattr(module, kernel, lambda *args: launches.append(args[0].shape) or real(*args))
    return launches


def check_against_reference(q, k, v, dout, causal, dtype):
    """flash_attention's output, LSE and gradients against the float64 reference."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out, lse = flash_attention(q, k, v, causal=causal, return_lse=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = attention_ref(qd, kd, vd, causal=causal)
    ref_grads = torch.autograd.grad(ref_out, (qd, kd, vd), dout.double())
    out_tol, grad_tol = TOLERANCE[dtype]
    assert_close("out", out, ref_out.to(dtype), out_tol)
    assert_close("lse", lse, ref_lse.float(), out_tol)
    for name, a, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert_close(name, a, r.to(dtype), grad_tol)


@needs_hopper
@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 4, 2, 37, 129, 64), (1, 2, 1, 1, 1, 128), (1, 3, 3, 300, 300, 128),
                                   (1, 2, 2, 640, 640, 64), (2, 2, 1, 129, 1000, 64), (1, 2, 2, 200, 333, 128)],
                         ids=str)
def test_hopper_forward_odd_shapes(shape, causal, dtype, monkeypatch):
    """The warp-specialised forward (forced on) on ragged, tiny and GQA shapes, seq_k >= seq_q with the causal
    diagonal bottom-right: output, LSE and the gradients computed from them, every output element written."""
    batch, heads_q, heads_kv, seq_q, seq_k, head_dim = shape
    torch.manual_seed(seq_q + seq_k)
    q = randn(batch, heads_q, seq_q, head_dim, dtype=dtype)
    k, v = (randn(batch, heads_kv, seq_k, head_dim, dtype=dtype) for _ in range(2))
    dout = randn(batch, heads_q, seq_q, head_dim, dtype=dtype)
    launches = hopper_launches(monkeypatch)
    with dispatch.hopper_forward("always"):
        check_against_reference(q, k, v, dout, causal, dtype)
    assert len(launches) == 1


@needs_hopper
@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hopper_forward_strided_views(causal, monkeypatch):
    """q, k, v as the GPT hands them over: (B, N, H, D) slices of one qkv projection, seen as (B, H, N, D)."""
    qkv = randn(2, 1000, 3, 4, 128, dtype=torch.bfloat16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    dout = randn(2, 4, 1000, 128, dtype=torch.bfloat16)
    launches = hopper_launches(monkeypatch)
    with dispatch.hopper_forward("always"):
        check_against_reference(q, k, v, dout, causal, torch.bfloat16)
    assert len(launches) == 1


@needs_hopper
@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("fp8", [None, "forward"], ids=["bf16", "fp8"])
@pytest.mark.parametrize("shape", [(2, 3, 3, 1000, 1000, 128), (3, 4, 2, 300, 357, 128), (3, 2, 1, 700, 900, 256),
                                   (1, 2, 2, 4096, 4096, 256), (1, 5, 5, 4096, 4096, 128)], ids=str)
def test_hopper_forward_causal_sections(shape, fp8, monkeypatch):
    """The Hopper forwards (16-bit and FP8) with causal query blocks in 1, 2 and 3 launch sections of (batch, head)
    pairs (as even as can be: 5 pairs in 3 are 2, 2 and 1) and by the rule: the same output and LSE bits as head
    by head (a section a pair)."""
    batch, heads_q, heads_kv, seq_q, seq_k, head_dim = shape
    if fp8 is None and head_dim not in hopper_tiles.HOPPER_FWD_CONFIGS:
        pytest.skip(f"no 16-bit Hopper forward at head_dim {head_dim}")
    torch.manual_seed(seq_q)
    q = randn(batch, heads_q, seq_q, head_dim, dtype=torch.bfloat16)
    k, v = (randn(batch, heads_kv, seq_k, head_dim, dtype=torch.bfloat16) for _ in range(2))
    launches = hopper_launches(monkeypatch, "attention_fwd_hopper" if fp8 is None else "attention_fp8_fwd_hopper")
    results = []
    with dispatch.hopper_forward("always"), torch.no_grad():
        for sections in (batch * heads_q, 1, 2, 3, None):
            monkeypatch.setattr(masking, "CAUSAL_SECTIONS", sections)
            results.append(flash_attention(q, k, v, causal=True, fp8=fp8, return_lse=True))
    assert len(launches) == len(results) and torch.isfinite(results[0][0]).all()
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])


@needs_hopper
def test_hopper_forward_falls_back_where_it_does_not_apply(monkeypatch):
    """Inputs the Hopper kernel does not take run the Triton forward, with the right result."""
    launches = hopper_launches(monkeypatch)
    q = randn(1, 2, 300, 64, dtype=torch.bfloat16)
    k, v = (randn(1, 2, 200, 64, dtype=torch.bfloat16) for _ in range(2))
    wide = randn(1, 2, 300, 72, dtype=torch.bfloat16)
    misaligned = wide[..., 4:68]  # rows start 8 bytes past a 16-byte boundary
    cases = [dict(q=q, k=k, v=v, causal=True),  # seq_q > seq_k: rows that see no key
             dict(q=q, k=q, v=q, causal=False, key_padding_mask=torch.zeros(1, 300, dtype=torch.bool,
                                                                            device="cuda")),
             dict(q=q, k=q, v=q, causal=False, dropout_p=0.1),
             dict(q=misaligned, k=q, v=q, causal=False),
             dict(q=randn(1, 2, 300, 96, dtype=torch.bfloat16), k=randn(1, 2, 300, 96, dtype=torch.bfloat16),
                  v=randn(1, 2, 300, 96, dtype=torch.bfloat16), causal=False),
             dict(q=q.float(), k=q.float(), v=q.float(), causal=False),
             dict(q=q, k=q, v=q, causal=True, scale=-0.125)]  # scale <= 0: the max does not commute with it
    with dispatch.hopper_forward("always"):
        for case in cases:
            torch.manual_seed(0)
            out = flash_attention(**case)
            if case.get("dropout_p"):
                continue
            ref = attention_ref(case["q"], case["k"], case["v"], causal=case["causal"], scale=case.get("scale"),
                                key_padding_mask=case.get("key_padding_mask"))[0]
            assert_close("out", out, ref, TOLERANCE[out.dtype][0])
    assert launches == []
    with dispatch.hopper_forward("never"):
        flash_attention(q, q, q)
    assert launches == []


HOPPER_BWD_SHAPES = [(2, 4, 37, 129, 64, False), (1, 2, 1, 1, 64, False), (1, 2, 1, 1, 64, True),
                     (1, 3, 300, 300, 64, False), (1, 3, 300, 300, 64, True), (1, 2, 640, 640, 64, True),
                     (2, 2, 129, 1000, 64, False), (2, 2, 1000, 129, 64, False), (1, 2, 200, 200, 64, True)]


@needs_hopper
@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", HOPPER_BWD_SHAPES, ids=str)
def test_hopper_backward_odd_shapes(shape, dtype, monkeypatch):
    """The five-matmul backward (forced on) on ragged and tiny shapes, seq_q != seq_k when not causal:
    gradients against float64, every element of dQ, dK and dV written."""
    batch, heads, seq_q, seq_k, head_dim, causal = shape
    torch.manual_seed(seq_q + seq_k)
    q, dout = (randn(batch, heads, seq_q, head_dim, dtype=dtype) for _ in range(2))
    k, v = (randn(batch, heads, seq_k, head_dim, dtype=dtype) for _ in range(2))
    launches = hopper_launches(monkeypatch, "attention_bwd_hopper")
    with dispatch.hopper_backward("always"):
        check_against_reference(q, k, v, dout, causal, dtype)
    assert len(launches) == 1


@needs_hopper
@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hopper_backward_strided_views(causal, monkeypatch):
    """q, k, v as the GPT hands them over: (B, N, H, D) slices of one qkv projection, seen as (B, H, N, D)."""
    qkv = randn(2, 1000, 3, 4, 64, dtype=torch.bfloat16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    dout = randn(2, 1000, 4, 64, dtype=torch.bfloat16).transpose(1, 2)
    launches = hopper_launches(monkeypatch, "attention_bwd_hopper")
    with dispatch.hopper_backward("always"):
        check_against_reference(q, k, v, dout, causal, torch.bfloat16)
    assert len(launches) == 1


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("path, shape", [
    ("triton", (2, 6, 3, 1000, 1000, 128)), ("triton", (1, 5, 5, 4096, 4096, 128)),
    ("triton", (3, 2, 1, 700, 900, 256)), ("triton", (1, 4, 4, 4096, 4096, 256)),
    ("hopper", (2, 3, 3, 1000, 1000, 64)), ("hopper", (1, 5, 5, 8192, 8192, 64)),
    ("fp8", (3, 4, 2, 300, 357, 128)), ("fp8", (1, 5, 5, 4096, 4096, 128)), ("fp8", (1, 4, 4, 4096, 4096, 256)),
], ids=str)
def test_backward_causal_sections(path, shape, monkeypatch):
    """The causal backwards with their blocks in 1, 2 and 3 launch sections of (batch, head) pairs and by the rule
    (dQ's query blocks, dK/dV's key blocks; ``masking.causal_sections``), against head by head: the same dK and
    dV bits, and dQ's too but for the Hopper kernel ("hopper", forced on), whose dQ sums with atomics in the
    order its programs run (there within 1e-3 of head by head's, relative to dQ's largest)."""
    batch, heads_q, heads_kv, seq_q, seq_k, head_dim = shape
    if path == "hopper" and not (torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("the Hopper backward runs on sm_90 GPUs only")
    torch.manual_seed(seq_q + head_dim)
    q, dout = (randn(batch, heads_q, seq_q, head_dim, dtype=torch.bfloat16) for _ in range(2))
    k, v = (randn(batch, heads_kv, seq_k, head_dim, dtype=torch.bfloat16) for _ in range(2))
    fp8 = "full" if path == "fp8" else None
    launches = hopper_launches(monkeypatch, "attention_bwd_hopper")
    results = []
    with dispatch.hopper_backward("always" if path == "hopper" else "never"):
        for sections in (batch * heads_q, 1, 2, 3, None):
            monkeypatch.setattr(masking, "CAUSAL_SECTIONS", sections)
            results.append(outputs_and_grads(lambda *t: flash_attention(*t, causal=True, fp8=fp8), q, k, v, dout))
    assert len(launches) == (len(results) if path == "hopper" else 0)
    head_by_head = results[0]
    assert all(torch.isfinite(t).all() for t in head_by_head)
    for out, dq, dk, dv in results[1:]:
        assert torch.equal(out, head_by_head[0]) and torch.equal(dk, head_by_head[2])
        assert torch.equal(dv, head_by_head[3])
        if path == "hopper":
            assert (dq - head_by_head[1]).abs().max() <= 1e-3 * head_by_head[1].abs().max()
        else:
            assert torch.equal(dq, head_by_head[1])


@needs_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_hopper_backward_error_at_most_twice_sdpa_flash_at_16k(causal, monkeypatch):
    """At 16k tokens the default ("auto") picks the Hopper backward for head_dim 64 without GQA; its
    gradients' error against float64 stays within 2x that of SDPA's flash backend."""
    torch.manual_seed(16)
    q, k, v, dout = (randn(1, 1, 16384, 64, dtype=torch.bfloat16) for _ in range(4))
    launches = hopper_launches(monkeypatch, "attention_bwd_hopper")
    ours = outputs_and_grads(lambda q, k, v: flash_attention(q, k, v, causal=causal), q, k, v, dout)
    assert len(launches) == 1

    def sdpa_flash(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    theirs = outputs_and_grads(sdpa_flash, q, k, v, dout)
    ref = outputs_and_grads(lambda q, k, v: attention_ref(q, k, v, causal=causal, upcast=False)[0],
                            q.double(), k.double(), v.double(), dout.double())
    for name, a, b, r in list(zip(("out", "dq", "dk", "dv"), ours, theirs, ref))[1:]:
        assert torch.isfinite(a).all(), f"{name}: NaN/inf"
        ours_err, sdpa_err = rel_error(a, r), rel_error(b, r)
        assert ours_err <= 2 * sdpa_err, f"{name}: error {ours_err:.3e} > 2 x SDPA flash's {sdpa_err:.3e}"


@needs_hopper
def test_hopper_backward_falls_back_where_it_does_not_apply(monkeypatch):
    """Inputs the Hopper backward does not take run the two Triton kernels, with the right gradients; so does
    ``torch.use_deterministic_algorithms(True)`` (its dQ sums with atomics)."""
    launches = hopper_launches(monkeypatch, "attention_bwd_hopper")
    # independent q, k, v: with k = q the scores peak on the diagonal and bf16 gradients lose ~10% to
    # cancellation in any implementation (eager bf16 attention included)
    q, k, v = (randn(1, 2, 300, 64, dtype=torch.bfloat16) for _ in range(3))
    k2, v2 = (randn(1, 2, 200, 64, dtype=torch.bfloat16) for _ in range(2))
    wide = randn(1, 2, 300, 72, dtype=torch.bfloat16)
    misaligned = wide[..., 4:68]  # rows start 8 bytes past a 16-byte boundary
    q128, k128, v128 = (randn(1, 2, 300, 128, dtype=torch.bfloat16) for _ in range(3))
    cases = [dict(q=q, k=k2, v=v2, causal=True),  # causal with seq_q != seq_k
             dict(q=q, k=k[:, :1], v=v[:, :1], causal=False),  # GQA
             dict(q=q, k=k, v=v, causal=False, key_padding_mask=torch.zeros(1, 300, dtype=torch.bool, device="cuda")),
             dict(q=q, k=k, v=v, causal=False, dropout_p=0.1),
             dict(q=misaligned, k=k, v=v, causal=False),
             dict(q=q128, k=k128, v=v128, causal=True),
             dict(q=q.float(), k=k.float(), v=v.float(), causal=False)]
    with dispatch.hopper_backward("always"):
        for case in cases:
            torch.manual_seed(0)
            dout = torch.randn_like(case["q"])
            if case.get("dropout_p"):
                q_, k_, v_ = (case[n].detach().requires_grad_() for n in ("q", "k", "v"))
                flash_attention(q_, k_, v_, causal=False, dropout_p=0.1).backward(dout)
                continue
            check = dict(q=case["q"], k=case["k"], v=case["v"], causal=case["causal"])
            ours = outputs_and_grads(lambda q, k, v: flash_attention(
                q, k, v, causal=check["causal"], key_padding_mask=case.get("key_padding_mask")),
                check["q"], check["k"], check["v"], dout)
            ref = outputs_and_grads(lambda q, k, v: attention_ref(
                q, k, v, causal=check["causal"], key_padding_mask=case.get("key_padding_mask"))[0],
                *(t.double() for t in (check["q"], check["k"], check["v"])), dout.double())
            for name, a, r in zip(("out", "dq", "dk", "dv"), ours, ref):
                assert_close(name, a, r.to(a.dtype), TOLERANCE[a.dtype][name != "out"])
        assert launches == []
        q_ = q.detach().requires_grad_()
        dout = torch.randn_like(q)  # not .sum(): its gradient is an expanded (stride-0) tensor, which TMA refuses
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            flash_attention(q_, k, v, causal=True).backward(dout)
        finally:
            torch.use_deterministic_algorithms(False)
        assert launches == []
        flash_attention(q_, k, v, causal=True).backward(dout)
        assert len(launches) == 1
    with dispatch.hopper_backward("never"):
        flash_attention(q_, k, v, causal=True).backward(dout)
    assert len(launches) == 1


def fp8_forward_both_ways(q, k, v, causal, **kwargs):
    """fp8="forward" (output, LSE) through the FP8 Hopper kernel and through the Triton FP8 kernel."""
    with dispatch.hopper_forward("always"):
        hopper = flash_attention(q, k, v, causal=causal, fp8="forward", return_lse=True, **kwargs)
    with dispatch.hopper_forward("never"):
        triton_ = flash_attention(q, k, v, causal=causal, fp8="forward", return_lse=True, **kwargs)
    return hopper, triton_


def assert_fp8_hopper_forward_as_close_as_triton(q, k, v, causal, monkeypatch):
    """fp8="forward" through the FP8 Hopper kernel (launched once): finite output and LSE, and as close to float64
    attention as through the Triton FP8 kernel, within 10% (+1e-3)."""
    launches = hopper_launches(monkeypatch, "attention_fp8_fwd_hopper")
    (out, lse), (ref_out, _) = fp8_forward_both_ways(q, k, v, causal)
    assert len(launches) == 1 and torch.isfinite(out).all() and torch.isfinite(lse).all()
    exact = attention_ref(q.double(), k.double(), v.double(), causal=causal)[0]
    assert rel_error(out, exact) <= 1.1 * rel_error(ref_out, exact) + 1e-3, (rel_error(out, exact),
                                                                             rel_error(ref_out, exact))


def assert_fp8_hopper_forward_agrees(out, lse, ref_out, ref_lse, head_dim):
    """The FP8 Hopper forward's (out, lse) against the Triton FP8 kernel's. Where it sums the scores in fp32 (head_dim
    256), on the same quantised operands: the same LSE bits (the softmax is the same computation) and the output
    within 1e-2 of the Triton one's largest value (the wgmma sums P V into its accumulator with its own FP8
    accumulation precision; measured at most 4e-3 in bf16 units). Where it sums them in float16 (head_dim 128: Q and
    K quantised to 16, not 448, so other e4m3 roundings, and the scale rounded to float16): the LSE within 1e-2 (the
    two measured 5e-3 apart at most on the H200) and the outputs within 3e-2 of each other
    (relative RMSE; 1.4e-2 measured)."""
    if fp8_scores_in_f16(head_dim):
        assert (lse - ref_lse).abs().max() <= 1e-2
        assert rel_error(out, ref_out) <= 3e-2
    else:
        assert torch.equal(lse, ref_lse)
        assert (out.float() - ref_out.float()).abs().max() <= 1e-2 * ref_out.float().abs().max()


@needs_hopper
@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(1, 2, 2, 1, 1, 128), (1, 2, 2, 129, 129, 128), (2, 4, 2, 200, 333, 128),
                                   (1, 2, 2, 37, 1000, 128), (1, 4, 1, 300, 300, 256), (2, 3, 3, 1000, 1000, 256),
                                   (1, 4, 2, 4096, 4096, 128), (1, 2, 1, 100, 357, 256), (1, 2, 1, 50, 300, 256)],
                         ids=str)
def test_fp8_hopper_forward_odd_shapes(shape, causal, monkeypatch):
    """The FP8 Hopper forward against the Triton FP8 kernel (``assert_fp8_hopper_forward_agrees``) and as close to
    float64 attention as it, within 2% (bf16 inputs, GQA, seq_q != seq_k, ragged tails, outputs poisoned). Among
    them, at head_dim 128 (three warpgroups), warpgroups that skip some of their CTA's key blocks (causal rows
    ending a block before the CTA's: 129, 200, 4096) or all of them (rows past seq_q: 200, 4096); at 256 (two
    warpgroups with ping-pong, which run every block of their CTA) seq_k > seq_q (100 x 357) and a warpgroup past
    seq_q (50 x 300)."""
    batch, heads_q, heads_kv, seq_q, seq_k, head_dim = shape
    torch.manual_seed(seq_q + head_dim)
    q = randn(batch, heads_q, seq_q, head_dim, dtype=torch.bfloat16)
    k, v = (randn(batch, heads_kv, seq_k, head_dim, dtype=torch.bfloat16) for _ in range(2))
    launches = hopper_launches(monkeypatch, "attention_fp8_fwd_hopper")
    (out, lse), (ref_out, ref_lse) = fp8_forward_both_ways(q, k, v, causal)
    assert len(launches) == 1 and torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert_fp8_hopper_forward_agrees(out, lse, ref_out, ref_lse, head_dim)
    exact = attention_ref(q.double(), k.double(), v.double(), causal=causal)[0]
    assert rel_error(out, exact) <= 1.02 * rel_error(ref_out, exact) + 1e-4


@needs_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp8_hopper_forward_f16_scores_backward(causal, monkeypatch):
    """fp8="forward"'s backward after the FP8 Hopper forward that sums the scores in float16 (head_dim 128; its
    scale rounded to float16, Q and K quantised to 16): the gradients as close to float64 attention's as after the
    Triton FP8 forward, within 10% (+1e-3), so the recomputed probabilities match the forward's LSE."""
    torch.manual_seed(7)
    q = randn(2, 4, 1000, 128, dtype=torch.bfloat16).requires_grad_()
    k, v = (randn(2, 2, 1000, 128, dtype=torch.bfloat16).requires_grad_() for _ in range(2))
    dout = randn(2, 4, 1000, 128, dtype=torch.bfloat16)
    launches = hopper_launches(monkeypatch, "attention_fp8_fwd_hopper")
    grads = {}
    for mode in ("always", "never"):
        with dispatch.hopper_forward(mode):
            out = flash_attention(q, k, v, causal=causal, fp8="forward")
        grads[mode] = torch.autograd.grad(out, (q, k, v), dout)
    assert len(launches) == 1
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    exact = torch.autograd.grad(attention_ref(qd, kd, vd, causal=causal)[0], (qd, kd, vd), dout.double())
    for name, g, g_triton, e in zip(("dq", "dk", "dv"), grads["always"], grads["never"], exact):
        assert torch.isfinite(g).all()
        assert rel_error(g, e) <= 1.1 * rel_error(g_triton, e) + 1e-3, (name, rel_error(g, e), rel_error(g_triton, e))


@needs_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("magnitude", [1e-4, 8.0, 1e3], ids=str)
def test_fp8_hopper_forward_f16_scores_at_extreme_magnitudes(magnitude, causal, monkeypatch):
    """Q and K scaled until the float16 scores' scale c underflows float16 (1e-4: held at 2^-24) or would let an
    exponent overflow it (8 and 1e3: those warpgroups take the exponent in fp32): finite, and as close to float64
    attention as the Triton FP8 kernel (within 10%, +1e-3; both are far off at 1e3, where the softmax is one-hot and
    e4m3's rounding of Q and K moves the argmax)."""
    torch.manual_seed(11)
    q, k, v = (randn(1, 4, 1000, 128, dtype=torch.bfloat16) for _ in range(3))
    q, k = (q * magnitude).bfloat16(), (k * magnitude).bfloat16()
    assert_fp8_hopper_forward_as_close_as_triton(q, k, v, causal, monkeypatch)


@needs_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [128, 256], ids=str)
@pytest.mark.parametrize("factors", [(1, 8, 1 / 8, 64, 1, 1 / 64, 8, 1), (64, 1, 1, 64, 1, 64, 1, 64)],
                         ids=["mixed", "64_and_1"])
def test_fp8_hopper_forward_q_tiles_of_other_magnitudes(factors, head_dim, causal, monkeypatch):
    """Q's 128-row scale tiles times the given factors, over 1000 rows (the last tile ragged): each softmax
    warpgroup (64 rows; three a CTA at head_dim 128, so a CTA spans two Q tiles) must take its own tile's scale, and
    at head_dim 128 a tile of 64 puts c past F16_C_MAX (~1.9 against ~0.03 for N(0, 1) entries), so warpgroups of
    one CTA take the float16 and the fp32 exponent side by side. As close to float64 attention as the Triton FP8
    kernel (within 10%, +1e-3)."""
    torch.manual_seed(19)
    row_factors = torch.tensor(factors, device="cuda", dtype=torch.float64).repeat_interleave(128)[:1000, None]
    q = (randn(1, 2, 1000, head_dim, dtype=torch.float64) * row_factors).bfloat16()
    k, v = (randn(1, 2, 1000, head_dim, dtype=torch.bfloat16) for _ in range(2))
    assert_fp8_hopper_forward_as_close_as_triton(q, k, v, causal, monkeypatch)


@needs_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [128, 256], ids=str)
@pytest.mark.parametrize("tiles", [(1, 1, 1e-37, 1e-37), (1e-37, 1, 1e-37, 1), (1, 1e-30, 1, 0), (0, 1e-20, 0, 1e-20),
                                   (0, 0, 1, 1)], ids=str)
def test_fp8_hopper_forward_v_tiles_of_scales_far_apart(tiles, head_dim, causal, monkeypatch):
    """V's key tiles (128 keys each) times the given factors, so their scales span up to 2^120 (a tile of 1e-37
    after a tile of N(0, 1)) or include all-zero tiles (scale 0): the FP8 Hopper forward's accumulator keeps its
    units within 2^60 of the largest V tile scale so far (``V_SCALE_SPAN``; units of 2^-126 after 2^-6 made the
    output infinite), and the output is finite and as close to float64 attention as the Triton FP8 kernel's
    (within 10%, +1e-3), also for a head of V ~1e-20 with all-zero tiles."""
    torch.manual_seed(13)
    q, k = (randn(1, 2, 512, head_dim, dtype=torch.bfloat16) for _ in range(2))
    factors = torch.tensor(tiles, device="cuda", dtype=torch.float64).repeat_interleave(128)[:, None]
    v = (randn(1, 2, 512, head_dim, dtype=torch.float64) * factors).bfloat16()
    assert_fp8_hopper_forward_as_close_as_triton(q, k, v, causal, monkeypatch)


@needs_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [128, 256], ids=str)
def test_fp8_hopper_forward_skipped_rescale_is_exact(head_dim, causal, monkeypatch):
    """SKIP_UNIT_RESCALE (each warp skips the output's rescale where its rows' factors are all 1) against the
    unconditional rescale, both head_dims whatever the config picks: the same output and LSE bits, on keys that grow
    along the sequence (row maxima that keep moving) and V tiles of other scales (units that change), GQA and a
    ragged tail."""
    hopper_module = importlib.import_module("flashtrain.kernels.hopper.fp8_fwd")
    torch.manual_seed(23)
    q = randn(1, 4, 1000, head_dim, dtype=torch.bfloat16)
    growth = torch.linspace(0.5, 3.0, 1000, device="cuda", dtype=torch.float64)[:, None]
    k = (randn(1, 2, 1000, head_dim, dtype=torch.float64) * growth).bfloat16()
    tile_factors = torch.tensor([1, 4, 0.25, 1, 1, 16, 1, 1], device="cuda", dtype=torch.float64)
    v = (randn(1, 2, 1000, head_dim, dtype=torch.float64) * tile_factors.repeat_interleave(128)[:1000, None]).bfloat16()
    real_meta = hopper_module.fp8_hopper_fwd_meta
    results = {}
    for skip in (False, True):
        monkeypatch.setattr(hopper_module, "fp8_hopper_fwd_meta",
                            lambda d, c, skip=skip: {**real_meta(d, c), "SKIP_UNIT_RESCALE": skip})
        clear_kept()
        with dispatch.hopper_forward("always"):
            results[skip] = flash_attention(q, k, v, causal=causal, fp8="forward", return_lse=True)
    (out, lse), (skipped_out, skipped_lse) = results[False], results[True]
    assert torch.isfinite(out).all()
    assert torch.equal(out.view(torch.int16), skipped_out.view(torch.int16))
    assert torch.equal(lse.view(torch.int32), skipped_lse.view(torch.int32))


@needs_hopper
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [128, 256], ids=str)
@pytest.mark.parametrize("magnitude", [1e-21, 1e-30], ids=str)
def test_fp8_hopper_forward_scores_scale_below_fp32_range(magnitude, head_dim, causal, monkeypatch):
    """tests/test_attention_fp8.py's test_scores_scale_below_fp32_range through the FP8 Hopper kernel (bf16, a
    ragged 1000 keys): Q and K this small make c = q_scale * k_scale * qk_scale underflow fp32, and a masked score
    times 0 was NaN in the fp32 scores (head_dim 256; the float16 scores held c >= 2^-24 already). Finite, and as
    close to float64 attention as the Triton FP8 kernel."""
    torch.manual_seed(17)
    q, k = ((randn(1, 2, 1000, head_dim, dtype=torch.float64) * magnitude).bfloat16() for _ in range(2))
    v = randn(1, 2, 1000, head_dim, dtype=torch.bfloat16)
    assert_fp8_hopper_forward_as_close_as_triton(q, k, v, causal, monkeypatch)


@needs_hopper
def test_fp8_hopper_forward_strided_views_and_modes(monkeypatch):
    """The trainer's layout (q, k, v strided views of one (B, N, 3, H, D) tensor), without rotation or K
    smoothing too, and a long causal sequence; against the Triton FP8 kernel as above."""
    torch.manual_seed(1)
    qkv = randn(2, 1024, 3, 8, 128, dtype=torch.bfloat16)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    long = [randn(1, 2, 16384, 256, dtype=torch.bfloat16) for _ in range(3)]
    launches = hopper_launches(monkeypatch, "attention_fp8_fwd_hopper")
    for (q_, k_, v_), kwargs in (((q, k, v), {}), ((q, k, v), dict(hadamard=False, smooth_k=False)), (long, {})):
        (out, lse), (ref_out, ref_lse) = fp8_forward_both_ways(q_, k_, v_, True, **kwargs)
        assert_fp8_hopper_forward_agrees(out, lse, ref_out, ref_lse, q_.shape[-1])
    assert len(launches) == 3


@needs_hopper
def test_fp8_hopper_forward_falls_back_where_it_does_not_apply(monkeypatch):
    """head_dim 64 (no config) and 40 (rotated to 64), causal with seq_q > seq_k, a negative scale, and the
    "never" mode run the Triton FP8 kernel, with its results."""
    torch.manual_seed(2)
    q, k, v = (randn(1, 2, 300, 128, dtype=torch.bfloat16) for _ in range(3))
    q64, k64, v64 = (randn(1, 2, 300, 64, dtype=torch.bfloat16) for _ in range(3))
    q40, k40, v40 = (randn(1, 2, 300, 40, dtype=torch.bfloat16) for _ in range(3))
    cases = [dict(q=q64, k=k64, v=v64, causal=True), dict(q=q40, k=k40, v=v40, causal=False),
             dict(q=q, k=k[:, :, :200], v=v[:, :, :200], causal=True), dict(q=q, k=k, v=v, causal=False, scale=-0.1)]
    launches = hopper_launches(monkeypatch, "attention_fp8_fwd_hopper")
    with dispatch.hopper_forward("always"):
        for case in cases:
            out = flash_attention(**case, fp8="forward")
            exact = attention_ref(*(case[n].double() for n in "qkv"), causal=case["causal"],
                                  scale=case.get("scale"))[0]
            assert rel_error(out, exact) < 0.1
    assert launches == []
    with dispatch.hopper_forward("never"):
        flash_attention(q, k, v, fp8="forward")
    assert launches == []


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("seq, fp8", [(300, None), (16384, None), (300, "full")], ids=str)
def test_tensors_on_a_gpu_that_is_not_current(seq, fp8):
    """Triton launches on the current CUDA device: with the tensors on cuda:1 and cuda:0 current, the op must
    still run on cuda:1 (the Triton kernels at 300 tokens, the Hopper ones at 16k, the FP8 path), and give what
    it gives with cuda:1 current."""
    torch.manual_seed(seq)
    device = torch.device("cuda", 1)
    q, k, v, dout = (torch.randn(1, 2, seq, 64, device=device, dtype=torch.bfloat16) for _ in range(4))

    def attend(q, k, v):
        return flash_attention(q, k, v, causal=True, fp8=fp8)

    assert torch.cuda.current_device() != 1
    elsewhere = outputs_and_grads(attend, q, k, v, dout)
    torch.cuda.synchronize(device)
    with torch.cuda.device(device):
        here = outputs_and_grads(attend, q, k, v, dout)
    for name, a, b in zip(("out", "dq", "dk", "dv"), elsewhere, here):
        assert a.device == device
        if seq >= dispatch.HOPPER_BWD_MIN_SEQ[dispatch.SM90][True] and name == "dq":  # summed by atomics: order varies
            assert rel_error(a, b) < 1e-2, name
        else:
            assert torch.equal(a, b), name


@needs_hopper
@pytest.mark.parametrize("q_magnitude", [1.0, 40.0], ids=str)
@pytest.mark.parametrize("smooth_k", [True, False], ids=["smooth_k", "plain_k"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp8_full_backward_reads_the_hopper_forwards_fp8(causal, smooth_k, q_magnitude):
    """fp8="full" at head_dim 128 through the FP8 Hopper forward: its Q and K are quantised to
    FP8_SCORES_AMAX (the float16 scores) in the backward's tiles, and the backward reads them; its gradients equal
    the float64 simulation of the backward on Q and K quantised so, up to bf16 rounding of the gradients. Q of
    40 N(0, 1): Q tile scales of 16 at that amax, where dK's quantisation factor overflowed at its floor
    (``kernels/fp8/bwd.py``: ``_ds_factor``); K then divided by 40, so that the scores are those of N(0, 1) inputs (the
    tensor cores sum FP8 products in ~14 bits: with scores 40x larger, dQ was 3.6e-2 from the simulation)."""
    from flashtrain.ops import fp8 as fp8_module
    from flashtrain.kernels.fp8.fwd import f16_softmax_scale, scores_amax
    from flashtrain.ops.reference import fp8_attention_bwd_ref

    torch.manual_seed(5)
    head_dim, seq = 128, 1000
    q = (randn(2, 4, seq, head_dim, dtype=torch.bfloat16) * q_magnitude).requires_grad_()
    k, v = (randn(2, 2, seq, head_dim, dtype=torch.bfloat16) for _ in range(2))
    k = (k / q_magnitude).requires_grad_()
    v.requires_grad_()
    dout = randn(2, 4, seq, head_dim, dtype=torch.bfloat16)
    scale = f16_softmax_scale(head_dim ** -0.5)  # the scale the float16 scores apply (passed in, it stays)
    with dispatch.hopper_forward("always"):
        amax = scores_amax(dispatch.fp8_forward(q, k, head_dim, causal, scale).kernel == dispatch.HOPPER, head_dim)
        assert amax == hopper_tiles.FP8_SCORES_AMAX and fp8_module._backward_reads_forward_tiles(q, k, head_dim)
        out, lse = flash_attention(q, k, v, causal=causal, scale=scale, fp8="full", return_lse=True,
                                   smooth_k=smooth_k)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    signs = fp8_module._rotation_signs(head_dim, q.device)
    sim_grads = fp8_attention_bwd_ref(q, k, v, out, lse, dout, tiles=fp8_tiles.fp8_bwd_tiles(seq, head_dim),
                                      causal=causal, scale=scale, signs=signs, smooth_k=smooth_k, scores_amax=amax)
    for name, g, s in zip(("dq", "dk", "dv"), grads, sim_grads):
        assert torch.isfinite(g).all() and rel_error(g, s) < 1e-2, (name, rel_error(g, s))


@pytest.mark.parametrize("smooth_k", [True, False], ids=["smooth_k", "plain_k"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_bf16_fp8_forward_and_full_backward(head_dim, causal, smooth_k):
    """The FP8 kernels compiled for the GPU: forward error within 10% (+1e-3) of the float64 simulation's,
    full backward equal to its simulation up to bf16 rounding of the gradients."""
    from flashtrain.ops.fp8 import _rotation_signs
    from flashtrain.ops.reference import fp8_attention_bwd_ref, fp8_attention_ref

    torch.manual_seed(head_dim)
    batch, heads_q, heads_kv, seq = 2, 4, 2, 1000
    q = randn(batch, heads_q, seq, head_dim, dtype=torch.bfloat16).requires_grad_()
    k, v = (randn(batch, heads_kv, seq, head_dim, dtype=torch.bfloat16).requires_grad_() for _ in range(2))
    dout = randn(batch, heads_q, seq, head_dim, dtype=torch.bfloat16)
    out, lse = flash_attention(q, k, v, causal=causal, fp8="full", return_lse=True, smooth_k=smooth_k)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    signs = _rotation_signs(head_dim, q.device)
    cfg = fp8_tiles.fp8_config(seq, head_dim)
    exact = attention_ref(q, k, v, causal=causal)[0].double()
    sim = fp8_attention_ref(q, k, v, causal=causal, block_m=cfg["BLOCK_M"], block_n=cfg["BLOCK_N"], signs=signs,
                           smooth_k=smooth_k)
    assert rel_error(out, exact) <= 1.1 * rel_error(sim, exact) + 1e-3
    sim_grads = fp8_attention_bwd_ref(q, k, v, out, lse, dout, tiles=fp8_tiles.fp8_bwd_tiles(seq, signs.numel()),
                                      causal=causal, signs=signs, smooth_k=smooth_k)
    for name, g, s in zip(("dq", "dk", "dv"), grads, sim_grads):
        assert torch.isfinite(g).all() and rel_error(g, s) < 1e-2, (name, rel_error(g, s))
