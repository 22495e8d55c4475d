"""chunked_cross_entropy: equal to F.cross_entropy on the full logits (values and gradients, fp64 to 1e-12, with
ignored targets and ragged chunks), gradcheck, fp32/bf16/autocast dtypes, grad_output scaling, argument errors, and
that no tensor of N x V elements is ever saved or created."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from flashtrain.trainer.loss import chunked_cross_entropy


def make(n, v, c, dtype=torch.float64, ignored_every=5, seed=0):
    """hidden (n, c) and weight (v, c) leaves of ``dtype``, targets (n,) with every ``ignored_every``-th -100."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, c, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    weight = (torch.randn(v, c, generator=g, dtype=torch.float64) * 0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    if ignored_every:
        targets[::ignored_every] = -100
    return hidden, weight, targets


def loss_and_grads(fn, hidden, weight, targets, **kw):
    loss = fn(hidden, weight, targets, **kw)
    return (loss, *torch.autograd.grad(loss, (hidden, weight)))


def reference(hidden, weight, targets, reduction="mean", ignore_index=-100):
    logits = hidden @ weight.T
    if logits.dtype != torch.float64:
        logits = logits.float()
    return F.cross_entropy(logits, targets, reduction=reduction, ignore_index=ignore_index)


class Record(TorchDispatchMode):
    """Every op's largest output numel, and the input dtypes of every matmul."""

    def __init__(self):
        super().__init__()
        self.max_numel, self.mm_dtypes = 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.mm_dtypes.add(tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.max_numel = max(self.max_numel, o.numel())
        return out


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [1, 8, 64])  # 37 rows: ragged last chunk, one chunk larger than N
def test_float64_matches_cross_entropy(reduction, chunk):
    hidden, weight, targets = make(37, 11, 6)
    got = loss_and_grads(chunked_cross_entropy, hidden, weight, targets, chunk_tokens=chunk, reduction=reduction)
    want = loss_and_grads(reference, hidden, weight, targets, reduction=reduction)
    assert got[0].dtype == torch.float64
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def test_other_ignore_index_and_leading_dims():
    hidden, weight, targets = make(24, 9, 4, ignored_every=0)
    targets[::3] = 2  # ignore a real class: its rows drop out, class 2 elsewhere too
    # (B, T, C) hidden and (B, T) targets flatten to tokens
    loss = chunked_cross_entropy(hidden.view(2, 12, 4), weight, targets.view(2, 12), chunk_tokens=5, ignore_index=2)
    want = reference(hidden, weight, targets, ignore_index=2)
    torch.testing.assert_close(loss, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_targets_ignored(reduction):
    hidden, weight, _ = make(10, 7, 3)
    targets = torch.full((10,), -100)
    got = loss_and_grads(chunked_cross_entropy, hidden, weight, targets, chunk_tokens=4, reduction=reduction)
    want = loss_and_grads(reference, hidden, weight, targets, reduction=reduction)
    # F.cross_entropy gives NaN (0/0) for "mean", 0 for "sum", and zero gradients either way
    assert torch.isnan(want[0]).item() == (reduction == "mean")
    torch.testing.assert_close(got[0], want[0], equal_nan=True)
    for g, w in zip(got[1:], want[1:]):
        assert torch.equal(g, w) and not g.any()


def test_gradcheck():
    hidden, weight, targets = make(7, 5, 3, ignored_every=3)
    assert torch.autograd.gradcheck(
        lambda h, w: chunked_cross_entropy(h, w, targets, chunk_tokens=3), (hidden, weight))


def test_float32_close_to_float64():
    h64, w64, targets = make(50, 40, 16)
    h32, w32 = (t.detach().float().requires_grad_() for t in (h64, w64))
    got = loss_and_grads(chunked_cross_entropy, h32, w32, targets, chunk_tokens=16)
    want = loss_and_grads(chunked_cross_entropy, h64, w64, targets, chunk_tokens=16)
    assert [t.dtype for t in got] == [torch.float32] * 3
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-6)


def test_bfloat16_inputs():
    h32, w32, targets = make(64, 50, 32, dtype=torch.float32)
    hb, wb = (t.detach().bfloat16().requires_grad_() for t in (h32, w32))
    loss, gh, gw = loss_and_grads(chunked_cross_entropy, hb, wb, targets, chunk_tokens=24)
    loss32, gh32, gw32 = loss_and_grads(chunked_cross_entropy, h32, w32, targets, chunk_tokens=24)
    assert loss.dtype == torch.float32 and gh.dtype == torch.bfloat16 and gw.dtype == torch.bfloat16
    assert abs(loss.item() - loss32.item()) <= 1e-2 * abs(loss32.item())
    for g, w in ((gh, gh32), (gw, gw32)):
        assert (g.float() - w).norm() <= 2e-2 * w.norm()
    # the same bf16 matmul then fp32 softmax as F.cross_entropy((hidden @ weight.T).float())
    torch.testing.assert_close(loss, reference(hb, wb, targets), rtol=1e-4, atol=0)


def test_autocast_runs_the_matmuls_in_bfloat16():
    hidden, weight, targets = make(40, 30, 16, dtype=torch.float32)
    rec = Record()
    with torch.autocast("cpu", dtype=torch.bfloat16), rec:
        loss, gh, gw = loss_and_grads(chunked_cross_entropy, hidden, weight, targets, chunk_tokens=16)
    assert rec.mm_dtypes == {(torch.bfloat16, torch.bfloat16)}
    assert loss.dtype == gh.dtype == gw.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = loss_and_grads(lambda h, w, t: F.cross_entropy(F.linear(h, w).float(), t), hidden, weight, targets)
    torch.testing.assert_close(loss, want[0], rtol=1e-4, atol=0)
    for g, w in zip((gh, gw), want[1:]):
        assert (g - w).norm() <= 2e-2 * w.norm()


def test_grad_output_scales_gradients():
    hidden, weight, targets = make(20, 9, 4)
    loss = chunked_cross_entropy(hidden, weight, targets, chunk_tokens=6)
    g1 = torch.autograd.grad(loss, (hidden, weight), retain_graph=True)
    g2 = torch.autograd.grad(2 * loss, (hidden, weight))
    for a, b in zip(g1, g2):
        assert a.abs().sum() > 0
        torch.testing.assert_close(b, 2 * a, rtol=0, atol=1e-15)


def test_only_the_needed_gradients():
    hidden, weight, targets = make(20, 9, 4)
    hidden.requires_grad_(False)
    chunked_cross_entropy(hidden, weight, targets, chunk_tokens=6).backward()
    weight_grad = weight.grad
    weight.grad = None
    reference(hidden, weight, targets).backward()
    assert hidden.grad is None
    torch.testing.assert_close(weight_grad, weight.grad, rtol=0, atol=1e-12)
    with torch.no_grad():
        loss = chunked_cross_entropy(hidden, weight, targets, chunk_tokens=6)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, reference(hidden, weight, targets), rtol=0, atol=1e-12)


@pytest.mark.skipif(not hasattr(torch.nn, "LinearCrossEntropyOptions"), reason="torch without the chunked "
                    "F.linear_cross_entropy (LinearCrossEntropyOptions)")
def test_matches_torch_linear_cross_entropy():
    hidden, weight, targets = make(33, 12, 5)
    got = loss_and_grads(chunked_cross_entropy, hidden, weight, targets, chunk_tokens=8)
    opts = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=8)
    want = loss_and_grads(lambda h, w, t: F.linear_cross_entropy(h, w, t, options=opts), hidden, weight, targets)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)


def test_no_tensor_of_tokens_times_vocab():
    n, v, c, chunk = 512, 1000, 16, 64
    hidden, weight, targets = make(n, v, c, dtype=torch.float32)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    rec = Record()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), rec:
        loss = chunked_cross_entropy(hidden, weight, targets, chunk_tokens=chunk)
        loss.backward()
    # what backward keeps: the two gradients, nothing vocab-sized per token
    assert sorted(saved) == sorted([(n, c), (v, c)])
    # what any op created, forward and backward: at most one chunk of logits
    assert rec.max_numel == chunk * v < n * v
    # the plain loss does materialise N x V (the check can see it)
    rec = Record()
    with rec:
        reference(hidden, weight, targets).backward()
    assert rec.max_numel == n * v


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8", None])
def test_chunk_tokens_must_be_a_positive_int(bad):
    hidden, weight, targets = make(4, 3, 2)
    with pytest.raises(ValueError, match=f"chunk_tokens={bad!r}: expected an int >= 1"):
        chunked_cross_entropy(hidden, weight, targets, chunk_tokens=bad)


def test_argument_errors():
    hidden, weight, targets = make(4, 3, 2)
    with pytest.raises(ValueError, match="reduction='none': expected one of"):
        chunked_cross_entropy(hidden, weight, targets, reduction="none")
    with pytest.raises(TypeError, match="ignore_index=-100.0: expected an int"):
        chunked_cross_entropy(hidden, weight, targets, ignore_index=-100.0)
    with pytest.raises(ValueError, match=r"weight: shape \(3, 5\) .* with C=2 from hidden"):
        chunked_cross_entropy(hidden, torch.randn(3, 5, dtype=torch.float64), targets)
    with pytest.raises(ValueError, match=r"targets: shape \(5,\) .* of shape \(4,\)"):
        chunked_cross_entropy(hidden, weight, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="targets: .* dtype torch.float32: expected integer class indices"):
        chunked_cross_entropy(hidden, weight, targets.float())
    with pytest.raises(ValueError, match="hidden dtype torch.float64 and weight dtype torch.float32"):
        chunked_cross_entropy(hidden, weight.detach().float(), targets)
