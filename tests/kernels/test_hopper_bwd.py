"""Checks of the Hopper backward's helper kernels, on the CPU through the interpreter and on any GPU (its Gluon
kernel runs on sm_90 GPUs only: see the gpu tests in tests/ops/test_gpu.py): the dQ buffer's fragment order and
its zeroing by the delta kernel."""

import pytest
import torch


def wgmma_fragments_to_buffer(dq: torch.Tensor) -> torch.Tensor:
    """dq (B, H, N, 64) in the Hopper kernel's buffer layout, built from the PTX ISA's wgmma accumulator
    fragment (m64nNk16, f32): thread t = 32 * w + lane holds register i at row 16 * w + lane // 4 + 8 * ((i // 2)
    % 2), column 8 * (i // 4) + 2 * (lane % 4) + i % 2; the buffer keeps each 64-row block warp by warp, and
    within a warp register group i // 4 of all lanes together, lane-major."""
    batch, heads, seq, head_dim = dq.shape
    n_blocks = -(-seq // 64)
    padded = torch.zeros(batch, heads, n_blocks * 64, head_dim, dtype=torch.float32)
    padded[:, :, :seq] = dq
    blocks = padded.view(batch, heads, n_blocks, 64, head_dim)
    buffer = torch.full((batch, heads, n_blocks, 64 * head_dim), float("nan"))
    for w in range(4):
        for lane in range(32):
            for i in range(head_dim // 2):
                row = 16 * w + lane // 4 + 8 * ((i // 2) % 2)
                col = 8 * (i // 4) + 2 * (lane % 4) + i % 2
                buffer[..., w * 16 * head_dim + (i // 4) * 128 + lane * 4 + i % 4] = blocks[..., row, col]
    assert not buffer.isnan().any()  # every position written once
    return buffer.view(batch, heads, n_blocks * 64, head_dim)


@pytest.mark.parametrize("seq", [1, 64, 129], ids=str)
@pytest.mark.usefixtures("poison_allocations")
def test_dq_from_fragments(seq, device):
    from flashtrain.kernels.hopper.bwd import dq_from_fragments

    torch.manual_seed(seq)
    dq_ref = torch.randn(2, 3, seq, 64)
    dq = torch.empty(2, seq, 3, 64, dtype=torch.float16, device=device).transpose(1, 2)  # strided, like the GPT's q
    dq_from_fragments(wgmma_fragments_to_buffer(dq_ref).to(device), dq, 0.3)
    assert torch.equal(dq.cpu(), (dq_ref * 0.3).half())


@pytest.mark.parametrize("seq", [1, 129], ids=str)
def test_delta_kernel_zeroes_the_dq_buffer(seq, device):
    """With the Hopper backward's dQ buffer, the delta kernel zeroes all of it (padding rows too) and gives the
    same delta as without."""
    from flashtrain.kernels.attention.bwd import backward_delta
    from flashtrain.kernels.hopper.bwd import dq_buffer

    torch.manual_seed(seq)
    out, do = (torch.randn(2, seq, 3, 64, dtype=torch.float16).to(device).transpose(1, 2) for _ in range(2))
    lse = torch.zeros(2, 3, seq, device=device)
    buffer = dq_buffer(out).fill_(float("nan"))
    assert buffer.shape == (2, 3, -(-seq // 64) * 64, 64)
    delta = backward_delta(out, do, None, lse, buffer)
    assert torch.equal(buffer, torch.zeros_like(buffer))
    torch.testing.assert_close(delta, (out.float() * do.float()).sum(-1), rtol=1e-5, atol=1e-5)
    assert torch.equal(delta, backward_delta(out, do, None, lse))
