"""Run by tests/distributed/test_ring.py: P gloo processes check ring_attention against flash_attention on the full
sequence (float64, through Triton's interpreter), and PyTorch's ring (``torch_ring_attention``, cases "torch_*")
against it too. Exits non-zero on a mismatch.

    TRITON_INTERPRET=1 python tests/distributed/ring_worker.py WORLD CASE[,CASE...] PORT
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# (batch, heads_q, heads_kv, seq, head_dim, causal)
CASES = {
    "causal": (1, 2, 2, 48, 16, True),
    "full": (2, 2, 2, 32, 24, False),
    "gqa_causal": (1, 4, 2, 64, 40, True),
    "odd_dim": (1, 2, 1, 40, 20, True),
    "torch_causal": (2, 2, 2, 48, 16, True),
    "torch_gqa": (1, 4, 2, 64, 24, True),
}


def run(rank: int, world: int, cases: str, port: int) -> None:
    """Each of the comma-separated ``cases`` in one process group."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for case in cases.split(","):
        if case == "errors":
            check_errors(rank, world)
        elif case.startswith("torch_"):
            check_torch(rank, case)
        else:
            check(rank, case)
    dist.destroy_process_group()


def check(rank: int, case: str) -> None:
    from flashtrain import flash_attention
    from flashtrain.distributed import ring_attention, shard_sequence, unshard_sequence

    batch, heads_q, heads_kv, seq, head_dim, causal = CASES[case]
    gen = torch.Generator().manual_seed(0)  # every rank draws the same full tensors
    q = torch.randn(batch, heads_q, seq, head_dim, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(batch, heads_kv, seq, head_dim, generator=gen, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(batch, heads_q, seq, head_dim, generator=gen, dtype=torch.float64)
    dlse = torch.randn(batch, heads_q, seq, generator=gen, dtype=torch.float64)

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attention(*full, causal=causal, return_lse=True)
    (out * dout).sum().add_((lse * dlse).sum()).backward()

    local = [shard_sequence(t, 2).requires_grad_() for t in (q, k, v)]
    out_l, lse_l = ring_attention(*local, causal=causal, return_lse=True)
    ((out_l * shard_sequence(dout, 2)).sum() + (lse_l * shard_sequence(dlse, 2)).sum()).backward()

    errors = {
        "out": (unshard_sequence(out_l.detach(), 2) - out).abs().max().item(),
        "lse": (unshard_sequence(lse_l.detach(), 2) - lse).abs().max().item(),
        **{f"d{n}": (unshard_sequence(t.grad, 2) - f.grad).abs().max().item()
           for n, t, f in zip("qkv", local, full)},
    }
    limit = {"lse": 1e-5}  # the LSE is returned in float32
    bad = {n: e for n, e in errors.items() if not e <= limit.get(n, 1e-10)}
    print(f"rank {rank} {case}: {errors}", flush=True)
    if bad:
        raise SystemExit(f"rank {rank} {case}: errors {bad}")


def check_torch(rank: int, case: str) -> None:
    """PyTorch's ring over its CPU SDPA kernel: outputs and gradients of the full sequence's attention (it merges
    the ring's partial results in float32, hence the looser bound)."""
    from flashtrain import flash_attention
    from flashtrain.distributed import shard_sequence, unshard_sequence
    from flashtrain.distributed.torch_ring import torch_ring_attention

    batch, heads_q, heads_kv, seq, head_dim, causal = CASES[case]
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(batch, heads_q, seq, head_dim, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(batch, heads_kv, seq, head_dim, generator=gen, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(batch, heads_q, seq, head_dim, generator=gen, dtype=torch.float64)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attention(*full, causal=causal)
    out.backward(dout)
    local = [shard_sequence(t, 2).requires_grad_() for t in (q, k, v)]
    out_l = torch_ring_attention(*local)
    out_l.backward(shard_sequence(dout, 2))
    errors = {"out": (unshard_sequence(out_l.detach(), 2) - out).abs().max().item(),
              **{f"d{n}": (unshard_sequence(t.grad, 2) - f.grad).abs().max().item()
                 for n, t, f in zip("qkv", local, full)}}
    print(f"rank {rank} {case}: {errors}", flush=True)
    if not max(errors.values()) <= 1e-5 or out_l.dtype != torch.float64:
        raise SystemExit(f"rank {rank} {case}: errors {errors}, dtype {out_l.dtype}")


def check_errors(rank: int, world: int) -> None:
    """Round trip of the layout; lengths that do not divide, and shards that differ between ranks, raise."""
    from flashtrain.distributed import positions, ring_attention, shard_sequence, unshard_sequence

    x = torch.arange(4 * world * 3, dtype=torch.float64).view(1, 4 * world, 3)
    local = shard_sequence(x, 1)
    assert torch.equal(local[0, :, 0] / 3, positions(4 * world, rank, world).double()), "positions"
    assert torch.equal(unshard_sequence(local, 1), x), "round trip"
    for bad in (lambda: shard_sequence(x[:, :-1], 1), lambda: unshard_sequence(local[:, :-1], 1)):
        try:
            bad()
        except ValueError as exc:
            assert "multiple of" in str(exc), exc
        else:
            raise SystemExit("a length that does not divide was accepted")
    seq = 8 if rank == 0 else 10  # shards of different lengths
    q = torch.randn(1, 2, seq, 16, dtype=torch.float64)
    try:
        ring_attention(q, q, q, causal=True)
    except ValueError as exc:
        assert "the ranks' shards differ" in str(exc), exc
    else:
        raise SystemExit("shards of different shapes were accepted")
    print(f"rank {rank} errors: ok", flush=True)


def main() -> None:
    world, cases, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    mp.spawn(run, args=(world, cases, port), nprocs=world, join=True)


if __name__ == "__main__":
    main()
