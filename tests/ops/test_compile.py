"""torch.compile(fullgraph=True) traces through flash_attention (no graph break) and matches eager."""

import warnings

import torch

from flashtrain import flash_attention


def loss_fn(x_q, x_k, x_v):
    # (B, N, H, D) in, as a model produces them; transposed views go straight into the op
    out = flash_attention(x_q.transpose(1, 2), x_k.transpose(1, 2), x_v.transpose(1, 2), causal=True)
    return out.transpose(1, 2).square().sum()


def test_compile_fullgraph_forward_backward(device):
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(1, 37, heads, 24, generator=gen, dtype=torch.float64).to(device).requires_grad_()
              for heads in (2, 1, 1)]
    eager_loss = loss_fn(*inputs)
    eager_grads = torch.autograd.grad(eager_loss, inputs)
    compiled = torch.compile(loss_fn, fullgraph=True)
    loss = compiled(*inputs)
    grads = torch.autograd.grad(loss, inputs)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-12, atol=1e-12)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


def test_eager_path_and_custom_ops_agree_bitwise(device):
    """Eager calls skip torch.library's dispatch (autograd.Function over the same launchers); the custom ops
    that compiled graphs use give the same bits, forward, LSE gradient and all, with padding and dropout."""
    from flashtrain.ops.attention import SEED_BOUND, _attention_fwd_op

    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 19, 24, generator=gen, dtype=torch.float32).to(device).requires_grad_()
    k, v = (torch.randn(2, 2, 23, 24, generator=gen, dtype=torch.float32).to(device).requires_grad_()
            for _ in range(2))
    kpm = torch.rand(2, 23, generator=gen).to(device) < 0.3
    weights = torch.randn(2, 4, 19, generator=gen).to(device)

    def run(use_op):
        torch.manual_seed(0)
        if use_op:
            seed = torch.randint(SEED_BOUND, (), dtype=torch.int64)
            out, lse2 = _attention_fwd_op(q, k, v, True, 24 ** -0.5, kpm, 0.2, seed, -1, -1, None, None, 0, 0)
            lse = (lse2 * 0.6931471805599453).float()
        else:
            out, lse = flash_attention(q, k, v, causal=True, key_padding_mask=kpm, dropout_p=0.2, return_lse=True)
        loss = out.square().sum() + (lse * weights).sum()
        return (out, lse, *torch.autograd.grad(loss, (q, k, v)))

    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)
    only_lse = flash_attention(q, k, v, return_lse=True)[1].sum()  # the output unused: its gradient is None
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(only_lse, (q, k, v)))


def test_compile_fullgraph_fp8(device):
    """The FP8 path compiles without a graph break too (its forward and both backwards are custom ops) and
    gives eager mode's bits."""
    gen = torch.Generator().manual_seed(2)
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    inputs = [torch.randn(1, 33, 2, 40, generator=gen).to(device=device, dtype=dtype).requires_grad_()
              for _ in range(3)]
    dout = torch.randn(1, 33, 2, 40, generator=gen).to(device=device, dtype=dtype)
    for mode in ("forward", "full"):
        torch._dynamo.reset()

        def fp8_attention(x_q, x_k, x_v):
            out = flash_attention(x_q.transpose(1, 2), x_k.transpose(1, 2), x_v.transpose(1, 2), causal=True,
                                  fp8=mode)
            return out.transpose(1, 2)

        eager = fp8_attention(*inputs)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled = torch.compile(fp8_attention, fullgraph=True)(*inputs)
        # Dynamo warns where it traces through a functools.cache wrapper (the device's capability was one)
        assert not [w for w in caught if "lru_cache" in str(w.message)], mode
        assert torch.equal(compiled, eager), mode
        for c, e in zip(torch.autograd.grad(compiled, inputs, dout), torch.autograd.grad(eager, inputs, dout)):
            assert torch.equal(c, e), mode
