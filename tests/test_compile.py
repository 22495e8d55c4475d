"""torch.compile(fullgraph=True) traces through flash_attention (no graph break) and matches eager."""

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
