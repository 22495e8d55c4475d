"""Context parallelism on this machine: gloo processes run ring_attention through Triton's interpreter and compare
it with flash_attention on the full sequence in float64 (outputs, LSE, dq, dk, dv); PyTorch's ring
(torch_ring_attention) likewise; the layout's round trip and its errors. Each case runs
tests/distributed/ring_worker.py in a subprocess of P spawned processes."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashtrain import flash_attention
from flashtrain.distributed import positions, ring_attention, shard_sequence, unshard_sequence

WORKER = Path(__file__).with_name("ring_worker.py")


def run_worker(world: int, case: str, port: int) -> str:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONSAFEPATH": "1"}
    result = subprocess.run([sys.executable, str(WORKER), str(world), case, str(port)], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


@pytest.mark.interpreter
@pytest.mark.parametrize("world, cases", [(2, "causal,full,odd_dim,torch_causal"), (4, "gqa_causal,errors,torch_gqa")])
def test_ring_attention_equals_full_attention(world, cases):
    """One process group per world size runs several cases (spawning the processes costs more than a case)."""
    stdout = run_worker(world, cases, 29600 + world)
    for case in cases.split(","):
        assert stdout.count(f" {case}: ") == world, stdout  # every rank reported the case


def test_one_process_falls_through_to_flash_attention(device):
    """No process group (or a group of one): the shard is the whole sequence and ring_attention is the op."""
    q, k, v = (torch.randn(1, 2, 12, 8, dtype=torch.float64, device=device) for _ in range(3))
    assert shard_sequence(q, 2) is q and unshard_sequence(q, 2) is q
    assert torch.equal(positions(12, 0, 1), torch.arange(12))
    assert torch.equal(ring_attention(q, k, v, causal=True), flash_attention(q, k, v, causal=True))


def test_positions_of_the_load_balanced_layout():
    assert positions(16, 0, 2).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert positions(16, 1, 2).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


@pytest.mark.parametrize("size, causal", [(2, True), (3, True), (2, False)])
def test_rank_by_rank_simulation_equals_full_attention(size, causal, device):
    """The ring's compute run rank after rank (scripts/bench/ring.py's simulation): the ranks' outputs, LSEs and
    gradients (each rank's dK/dV shares summed, as the ring sends them home) are the full sequence's."""
    from flashtrain.distributed.layout import shard_sequence_for
    from flashtrain.distributed.ring import rank_backward, rank_forward
    from flashtrain.ops.lse import LN2

    gen = torch.Generator().manual_seed(size)
    q, dout = (torch.randn(1, 4, 12 * size, 16, generator=gen, dtype=torch.float64).to(device) for _ in range(2))
    k, v = (torch.randn(1, 2, 12 * size, 16, generator=gen, dtype=torch.float64).to(device) for _ in range(2))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attention(*full, causal=causal, return_lse=True)
    out.backward(dout)
    shards = [[shard_sequence_for(t, 2, r, size) for t in (q, k, v, dout)] for r in range(size)]
    dk = [torch.zeros_like(shards[r][1]) for r in range(size)]
    dv = [torch.zeros_like(shards[r][2]) for r in range(size)]
    for r in range(size):
        q_r, _, _, dout_r = shards[r]
        out_r, lse_r = rank_forward(q_r, lambda j: shards[j][1:3], r, size, causal, 0.25)
        torch.testing.assert_close(out_r, shard_sequence_for(out.detach(), 2, r, size), rtol=0, atol=1e-12)
        torch.testing.assert_close(lse_r * LN2, shard_sequence_for(lse.double(), 2, r, size), rtol=0, atol=1e-6)
        dq_r, dkv = rank_backward(dout_r, q_r, out_r, lse_r, lambda j: shards[j][1:3], r, size, causal, 0.25)
        torch.testing.assert_close(dq_r, shard_sequence_for(full[0].grad, 2, r, size), rtol=0, atol=1e-12)
        for j, (dk_j, dv_j) in dkv.items():
            dk[j] += dk_j
            dv[j] += dv_j
    for r in range(size):
        torch.testing.assert_close(dk[r], shard_sequence_for(full[1].grad, 2, r, size), rtol=0, atol=1e-12)
        torch.testing.assert_close(dv[r], shard_sequence_for(full[2].grad, 2, r, size), rtol=0, atol=1e-12)


@pytest.mark.gpu
def test_torch_ring_runs_sdpa_flash_kernel_on_cuda(tmp_path):
    """PyTorch's ring on one CUDA rank (a group of one: the SDPA flash kernel's forward and backward with the extra
    outputs it hands from one to the other): bf16 output and gradients near flash_attention's."""
    import torch.distributed as dist

    from flashtrain.distributed.torch_ring import torch_ring_attention

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, dout = (torch.randn(2, 4, 256, 64, generator=gen, device="cuda", dtype=torch.bfloat16)
                         for _ in range(4))
        grads = []
        for fn in (torch_ring_attention, lambda *t: flash_attention(*t, causal=True)):
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            out = fn(*inputs)
            out.backward(dout)
            grads.append([out.detach(), *(t.grad for t in inputs)])
        for got, want in zip(*grads):
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got, want, rtol=0, atol=2e-2)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("shapes, message", [
    (((1, 2, 8, 16), (1, 2, 6, 16)), r"torch_ring_attention: q has 8 rows and k 6; expected the same even"),
    (((1, 2, 7, 16), (1, 2, 7, 16)), r"torch_ring_attention: q has 7 rows and k 7; expected the same even"),
    (((1, 3, 8, 16), (1, 2, 8, 16)), r"heads_q=3 \(q.shape\[1\]\) must be a multiple of heads_kv=2"),
    (((1, 2, 8, 16), (1, 2, 8, 8)), r"head dims differ"),
])
def test_torch_ring_refuses_shards_it_cannot_run(shapes, message):
    from flashtrain.distributed.torch_ring import torch_ring_attention

    q_shape, kv_shape = shapes
    with pytest.raises(ValueError, match=message):
        torch_ring_attention(torch.zeros(q_shape), torch.zeros(kv_shape), torch.zeros(kv_shape))
