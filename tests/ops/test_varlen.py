"""flash_attention_varlen against a reference that attends each packed sequence on its own (float64 where the
interpreter allows), with ragged and empty sequences, windows, GQA, strided views and rows past the last offset."""

import pytest
import torch

from flashtrain import flash_attention, flash_attention_varlen
from flashtrain.ops import dispatch
from flashtrain.ops.reference import attention_varlen_ref
from flashtrain.testing import assert_attention_close

# (lengths of q's sequences, of k's): empty sequences, a 1-token one, one longer than the interpreter's tiles,
# seq_q != seq_k per sequence
LENGTHS = {
    "ragged": ([5, 0, 37, 1, 20], [5, 0, 37, 1, 20]),
    "q_ne_k": ([5, 3, 37, 1, 20], [7, 0, 30, 4, 20]),
    "one_long": ([70], [70]),
}


def offsets(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def make_packed(lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype, device, tail=(0, 0), seed=0):
    """q (total_q, H_q, D), k, v (total_k, H_kv, D), with ``tail`` rows past the last offsets; the offsets."""
    gen = torch.Generator().manual_seed(seed)
    total_q, total_k = sum(lengths_q) + tail[0], sum(lengths_k) + tail[1]
    q = torch.randn(total_q, heads_q, head_dim, generator=gen)
    k = torch.randn(total_k, heads_kv, head_dim, generator=gen)
    v = torch.randn(total_k, heads_kv, head_dim, generator=gen)
    q, k, v = (t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v))
    return q, k, v, offsets(lengths_q, device), offsets(lengths_k, device)


def run_pair(q, k, v, cu_q, cu_k, causal, window=(-1, -1), scale=None):
    max_q = max(1, int((cu_q[1:] - cu_q[:-1]).max()))
    max_k = max(1, int((cu_k[1:] - cu_k[:-1]).max()))
    out, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, window_size=window,
                                      scale=scale, return_lse=True)
    ref, ref_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal, window_size=window, scale=scale)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    return (out, lse, grads), (ref, ref_lse, ref_grads)


# each set of lengths under every mask on q_ne_k, the others under one causal and one windowed mask each
VARLEN_CASES = [("q_ne_k", c, w) for c in (False, True) for w in ((-1, -1), (4, -1), (3, 2))] + [
    ("ragged", True, (-1, -1)), ("ragged", False, (3, 2)), ("one_long", True, (4, -1)), ("one_long", False, (-1, -1))]


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("lengths, causal, window", VARLEN_CASES, ids=str)
def test_varlen_matches_reference(lengths, causal, window, device):
    q, k, v, cu_q, cu_k = make_packed(*LENGTHS[lengths], 4, 2, 24, torch.float64, device)
    assert_attention_close(run_pair(q, k, v, cu_q, cu_k, causal, window), torch.float64)


@pytest.mark.usefixtures("poison_allocations")
def test_varlen_with_dk_and_dv_apart(device):
    """Packed sequences through the split dK/dV launches (``dispatch.split_dkdv``): right against the reference,
    with the keys past the last offset zeroed by each launch (a tail of rows)."""
    q, k, v, cu_q, cu_k = make_packed(*LENGTHS["q_ne_k"], 4, 2, 24, torch.float64, device, tail=(3, 5))
    with dispatch.split_dkdv("always"):
        ours, ref = run_pair(q, k, v, cu_q, cu_k, True)
    assert_attention_close((ours, ref), torch.float64)


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_varlen_low_precision(dtype, device):
    q, k, v, cu_q, cu_k = make_packed([40, 17, 64], [40, 17, 64], 2, 1, 40, dtype, device)
    assert_attention_close(run_pair(q, k, v, cu_q, cu_k, True), dtype)


@pytest.mark.usefixtures("poison_allocations")
def test_rows_past_the_last_offset(device):
    """Rows of q past cu_seqlens_q[-1] get zeros and an LSE of -inf, they and keys past cu_seqlens_k[-1] get no
    gradient; the poisoned allocations show that every such row is written."""
    q, k, v, cu_q, cu_k = make_packed([9, 30], [12, 30], 2, 2, 16, torch.float64, device, tail=(75, 6))
    pair = run_pair(q, k, v, cu_q, cu_k, True)
    assert_attention_close(pair, torch.float64)
    (out, lse, (dq, dk, dv)), _ = pair
    assert torch.equal(out[39:], torch.zeros_like(out[39:])) and torch.isneginf(lse[:, 39:]).all()
    assert not dq[39:].any() and not dk[42:].any() and not dv[42:].any()


def test_varlen_equals_dense_per_sequence(device):
    """Each sequence of the packed call is bitwise the dense op on that sequence alone (same tiles, same order)."""
    q, k, v, cu_q, cu_k = make_packed([13, 40], [13, 40], 2, 1, 16, torch.float32, device)
    out = flash_attention_varlen(q, k, v, cu_q, cu_k, 40, 40, causal=True)
    for a, b in ((0, 13), (13, 53)):
        dense = flash_attention(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), causal=True)
        assert torch.equal(out[a:b], dense[0].transpose(0, 1))


@pytest.mark.usefixtures("poison_allocations")
def test_strided_packed_views(device):
    """Slices of a fused (total, 3, H, D) QKV tensor go in without a copy."""
    qkv = torch.randn(60, 3, 2, 16, dtype=torch.float64, device=device)
    q, k, v = (qkv[:, i].detach().requires_grad_() for i in range(3))
    assert not q.is_contiguous()
    cu = offsets([25, 35], device)
    assert_attention_close(run_pair(q, k, v, cu, cu, True), torch.float64)


def test_varlen_gradcheck(device):
    q, k, v, cu_q, cu_k = make_packed([5, 0, 9], [7, 2, 9], 2, 1, 8, torch.float64, device, tail=(2, 1))
    assert torch.autograd.gradcheck(
        lambda q, k, v: flash_attention_varlen(q, k, v, cu_q, cu_k, 9, 9, causal=True, window_size=(3, -1)),
        (q, k, v), fast_mode=True)


def test_varlen_is_deterministic(device):
    q, k, v, cu_q, cu_k = make_packed([20, 33], [20, 33], 4, 2, 16, torch.float32, device)
    runs = []
    for _ in range(2):
        out = flash_attention_varlen(q, k, v, cu_q, cu_k, 33, 33, causal=True)
        runs.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_varlen_compiles_fullgraph(device):
    torch._dynamo.reset()
    q, k, v, cu_q, cu_k = make_packed([11, 20], [11, 20], 2, 1, 16, torch.float64, device)

    def loss(q, k, v):
        return flash_attention_varlen(q, k, v, cu_q, cu_k, 20, 20, causal=True, window_size=(5, -1)).square().sum()

    eager = loss(q, k, v)
    eager_grads = torch.autograd.grad(eager, (q, k, v))
    compiled = torch.compile(loss, fullgraph=True)(q, k, v)
    for a, b in zip((compiled, *torch.autograd.grad(compiled, (q, k, v))), (eager, *eager_grads)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _inputs(device):
    q, k, v, cu_q, cu_k = make_packed([4, 6], [4, 6], 2, 1, 8, torch.float32, device)
    return q.detach(), k.detach(), v.detach(), cu_q, cu_k


@pytest.mark.parametrize("change, error, match", [
    (dict(cu_seqlens_q=lambda cu: cu.long()), ValueError, "cu_seqlens_q has dtype torch.int64"),
    (dict(cu_seqlens_k=lambda cu: cu[None]), ValueError, "cu_seqlens_k has dtype torch.int32 and shape"),
    (dict(cu_seqlens_q=lambda cu: cu[:2]), ValueError, "one offset per sequence boundary"),
    (dict(cu_seqlens_q=lambda cu: cu.flip(0)), ValueError, "non-decreasing offsets starting at 0"),
    (dict(cu_seqlens_k=lambda cu: cu + 1), ValueError, "non-decreasing offsets starting at 0"),
    (dict(cu_seqlens_q=lambda cu: torch.tensor([0, 4, 12], dtype=torch.int32, device=cu.device)), ValueError,
     r"cu_seqlens_q\[-1\]=12 is past the 10 packed rows"),
    (dict(max_seqlen_q=0), ValueError, "max_seqlen_q=0"),
    (dict(max_seqlen_k=4), ValueError, "longer than max_seqlen=4"),
    (dict(window_size=(-3, 0)), ValueError, "window_size"),
    (dict(q=lambda q: q[None]), ValueError, "q must be 3-D"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_bad_input_is_refused(change, error, match, device):
    q, k, v, cu_q, cu_k = _inputs(device)
    args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=6, max_seqlen_k=6)
    for name, fn in change.items():
        args[name] = fn(args[name]) if callable(fn) else fn
    window = args.pop("window_size", (-1, -1))
    with pytest.raises(error, match=match):
        flash_attention_varlen(**args, window_size=window)


def test_offsets_are_read_once_per_tensor(device, monkeypatch):
    """On a GPU the same offsets tensor in every layer is read back once, and again after a write to it; CPU offsets
    are read every call (no device sync to save)."""
    from flashtrain.ops import varlen
    q, k, v, cu_q, cu_k = _inputs(device)
    reads = []
    monkeypatch.setattr(varlen, "_checked", {})
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or tolist(t))
    for _ in range(3):
        flash_attention_varlen(q, k, v, cu_q, cu_q, 6, 6)
    if not cu_q.is_cuda:
        assert len(reads) == 6  # q's and k's offsets, each call
        return
    assert len(reads) == 1  # one tensor passed as both: read once
    cu_q.add_(0)
    flash_attention_varlen(q, k, v, cu_q, cu_q, 6, 6)
    assert len(reads) == 2
