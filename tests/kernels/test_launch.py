"""flashtrain.kernels.launch: launches without Triton's per-call binding after a key's first launch."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import native_specialize_impl

from flashtrain import flash_attention
from flashtrain.kernels import launch
from flashtrain.kernels.fp8 import quant as fp8_quant
from flashtrain.kernels.fp8.quant import fp8_quantize
from flashtrain.ops.reference import fp8_quantize_ref
from flashtrain.testing import rel_error


def _specialisation(arg):
    return native_specialize_impl(BaseBackend, arg, False, True, True)


def test_arg_keys_are_at_least_as_fine_as_tritons_specialisation():
    """Two launch arguments with one ``arg_keys`` entry get one specialisation from Triton (so a compiled kernel looked up
    by the key is the one Triton would have compiled): integers around 1, 16 and the 32/64-bit limits, floats,
    bools, None, tensors of several dtypes at aligned and unaligned addresses."""
    base = torch.zeros(64, dtype=torch.float16)
    ints = [0, 1, 2, 15, 16, 17, 32, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -2**31, -2**31 - 1,
            -2**31 - 16, 2**32, 2**63 - 1, 2**63, 2**63 + 16, 2**64 - 1]
    tensors = [base, base[1:], base[8:], base[9:], base.float(), base.float()[1:], base.float()[4:],
               base.to(torch.float8_e4m3fn), base.to(torch.float8_e4m3fn)[3:], base.to(torch.bfloat16)]
    samples = [*ints, 0.0, 1.0, 1.5, -2.0, True, False, None, *tensors]
    keys = launch.arg_keys(samples)
    for a, key_a in zip(samples, keys):
        for b, key_b in zip(samples, keys):
            if key_a == key_b:
                assert _specialisation(a) == _specialisation(b), (a, b)
    # the key tells apart what the specialisation does (ints by class, not by value)
    k4096, k8192, k4097, k1, k_true, k_base, k_base1 = launch.arg_keys((4096, 8192, 4097, 1, True, base, base[1:]))
    assert k4096 == k8192 and k4096 != k4097 and k1 != k_true and k_base != k_base1


@triton.jit
def _scaled_copy_kernel(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < n) * 2, mask=offs < n)


def test_launch_kernel_is_the_jit_launch(device):
    """The same results as ``kernel[grid](...)`` on every call, the first (compiling) and later ones, for new sizes
    and for unaligned views; through the interpreter it is the JIT launch itself."""
    x = torch.arange(100, dtype=torch.float32, device=device)
    for start, n in [(0, 64), (0, 64), (0, 37), (1, 64), (1, 50), (0, 99)]:
        y = torch.full((n,), float("nan"), device=device)
        launch.launch_kernel(_scaled_copy_kernel, (triton.cdiv(n, 32),), x[start:start + n], y, n, BLOCK=32)
        assert torch.equal(y, x[start:start + n] * 2), (start, n)


def test_fixed_launch_is_the_jit_launch(device):
    """A ``FixedLaunch`` per size gives ``kernel[grid](...)``'s results on every call, the first (compiling) and later
    ones, for aligned and unaligned views of the same size; directly launched, each alignment gets its own compiled
    kernel."""
    x = torch.arange(100, dtype=torch.float32, device=device)
    launches = {n: launch.FixedLaunch(_scaled_copy_kernel, (triton.cdiv(n, 32),), (n,), dict(BLOCK=32))
                for n in (64, 37, 50)}
    for start, n in [(0, 64), (0, 64), (1, 64), (1, 64), (0, 64), (0, 37), (1, 50), (2, 50)]:
        y = torch.full((n,), float("nan"), device=device)
        launches[n](x[start:start + n], y)
        assert torch.equal(y, x[start:start + n] * 2), (start, n)
    if launch.DIRECT:
        assert len(launches[64].compiled) == 2  # x aligned and x[1:]


def test_kept_plans_are_made_again_after_clear_kept():
    """A ``kept`` plan is made once per signature and again after ``clear_kept`` (which a change to the module
    constants it read needs)."""
    made = []

    @launch.kept
    def plan(n):
        made.append(n)
        return object()

    first = plan(3)
    assert plan(3) is first and made == [3]
    launch.clear_kept()
    assert plan(3) is not first and made == [3, 3]


@pytest.mark.gpu
def test_fixed_launch_refuses_a_missing_constexpr(device):
    """A constexpr without a default must be given when the launch is made: refused there, not at a later launch."""
    if not launch.DIRECT:
        pytest.skip("direct launches are off for this Triton version")
    with pytest.raises(TypeError, match="BLOCK"):
        launch.FixedLaunch(_scaled_copy_kernel, (1,), (32,), {})


@pytest.mark.gpu
def test_positional_constexpr_is_refused(device):
    """A constexpr passed by position would be keyed like an ordinary integer (by class, not value): refused."""
    if not launch.DIRECT:
        pytest.skip("direct launches are off for this Triton version")
    x = torch.zeros(32, device=device)
    with pytest.raises(TypeError, match="BLOCK"):
        launch.launch_kernel(_scaled_copy_kernel, (1,), x, x, 32, 32)


@pytest.mark.gpu
def test_launch_hooks_see_every_launch(device):
    """With a launch hook registered (profilers read its metadata), every launch goes through Triton's JIT, also
    those of a key already compiled: the hook sees each one."""
    if not launch.DIRECT:
        pytest.skip("direct launches are off for this Triton version")
    from triton import knobs
    seen = []

    def hook(metadata):
        seen.append(metadata)

    x = torch.arange(64, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    for _ in range(2):  # compiled, then launched directly: the key is known before the hook is set
        launch.launch_kernel(_scaled_copy_kernel, (2,), x, y, 64, BLOCK=32)
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        for _ in range(3):
            launch.launch_kernel(_scaled_copy_kernel, (2,), x, y, 64, BLOCK=32)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(seen) == 3
    assert torch.equal(y, x * 2)


@pytest.mark.gpu
def test_unaligned_input_gets_its_own_compiled_kernel(device):
    """fp8_quantize of a 16-byte aligned view and of an unaligned one of the same shape and strides, in both orders:
    Triton compiles the aligned case with wider loads, so reusing it for the other would read wrong addresses.
    Both match the reference bit for bit, and the unaligned launch adds a compiled entry of its own."""
    if not launch.DIRECT:
        pytest.skip("direct launches are off for this Triton version")
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(1, 2, 96, 130, generator=gen).to(device, torch.bfloat16)
    views = {"aligned": base[..., :128], "unaligned": base[..., 1:129]}
    assert views["aligned"].data_ptr() % 16 == 0 and views["unaligned"].data_ptr() % 16 == 2
    for order in (["aligned", "unaligned"], ["unaligned", "aligned"]):
        for name in order * 2:
            x = views[name]
            q, scales = fp8_quantize(x, 64)
            ref_q, ref_scales = fp8_quantize_ref(x.float(), 64)
            assert torch.equal(scales, ref_scales), name
            assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)), name
    x = views["aligned"]
    plan = fp8_quant._quantize_plan(tuple(x.shape), x.stride(), x.dtype, x.device, 64, False, None, False, 1.0, False,
                                    False, fp8_quant.E4M3_MAX)
    assert {key[1] for key in plan.launch.compiled} >= {(torch.bfloat16, True), (torch.bfloat16, False)}  # x's


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [None, "full"], ids=["bf16", "fp8_full"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_direct_launches_give_the_jit_launches_bits(fp8, causal, monkeypatch, device):
    """The attention op's forward and backward (every kernel they launch, side passes included; at 4k tokens and
    head_dim 128 the Hopper kernels), launched directly and through the JIT, on the second call of each (the first
    compiles): bit-identical outputs and gradients, except the bf16 Hopper backward's dQ, which it sums with
    atomics (in no fixed order: its last bits vary from run to run, README)."""
    if not launch.DIRECT:
        pytest.skip("direct launches are off for this Triton version")
    gen = torch.Generator().manual_seed(8)
    q, k, v, do = (torch.randn(1, 4, 4096, 128, generator=gen).to(device, torch.bfloat16) for _ in range(4))

    def run():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flash_attention(*leaves, causal=causal, fp8=fp8)
        out.backward(do)
        return [out.detach(), *(t.grad for t in leaves)]

    run()
    direct = run()
    monkeypatch.setattr(launch, "DIRECT", False)
    run()
    jit = run()
    for name, a, b in zip(["out", "dq", "dk", "dv"], direct, jit):
        if name == "dq" and fp8 is None:
            assert rel_error(a, b) < 1e-3
        else:
            assert torch.equal(a, b), name


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script runs the benchmark")
def test_host_time_benchmark_needs_a_gpu(monkeypatch, tmp_path):
    """scripts/bench/host_time.py (the paired timing of both launch paths) says what it needs where it cannot run."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "host_time.py"
    spec = importlib.util.spec_from_file_location("bench_host_time", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["host_time.py", "--out", str(tmp_path / "host.csv")])
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        module.main()
