"""Kernel launches that skip Triton's per-call argument binding once a specialisation has been compiled.

``kernel[grid](*args, **constexprs)`` binds and specialises every argument on every call before the compiled
kernel's launcher runs. On the H200 box's host that took 37 us a launch of ``fp8_quantize_kernel`` (23 arguments,
15 constexprs and options), of which the compiled kernel's own launcher took 10; the FP8 forward makes four such
launches a call (benchmarks/NOTES.md, twenty-second session). ``launch_kernel`` keeps, per kernel and per key of its
arguments, the compiled kernel the first JIT launch returned, and later calls its launcher directly. Measured on
the H200 box (``scripts/bench_host_time.py``, both paths in alternating rounds of one process; per-case medians of
the paired differences, benchmarks/results/host_time_direct_launch_h200_2026-11-30_run2.csv): 9-14 us less host
time per bf16 forward (one launch), 46-99 us per FP8 forward (four), 155-237 us per bf16 forward + backward and
188-316 us per ``fp8="full"`` forward + backward.

The key holds everything Triton 3.6 specialises a kernel on, or finer (``arg_keys``), so two calls with one key
compile to the same kernel. Only Triton 3.6's launcher contract has been read (``JITFunction.run``,
``CompiledKernel.run``): other versions, Triton's interpreter, and launches with a launch hook set (profilers
read the hook's metadata) take the JIT path.
"""

from __future__ import annotations

import os

import torch
import triton

# Read once, when the kernels are defined: ``triton.jit`` makes interpreted kernels only if
# TRITON_INTERPRET=1 was set before triton was imported, so a later change would not take effect.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# (major, minor) of the Triton versions whose JITFunction.run this module repeats
_CHECKED_TRITON = {(3, 6)}
DIRECT = not INTERPRET and tuple(int(p) for p in triton.__version__.split(".")[:2]) in _CHECKED_TRITON
# Entries: (id(kernel), device, argument keys, constexprs and options) -> (compiled kernel, trailing parameter
# values). Kernels live as long as their modules, so id() names one (JITFunction's own hash takes a lock).
_compiled: dict = {}
_2_31, _2_63 = 2**31, 2**63

if DIRECT:
    from triton import knobs
    from triton.runtime.driver import driver


def arg_keys(args: tuple) -> tuple:
    """Per launch argument, what Triton's specialisation of it depends on, or finer. Tensors: the dtype and whether
    the address is 16-byte aligned; integers: whether one, whether a multiple of 16, and the 32/64-bit range (so
    sequence lengths, strides and seeds that change do not add keys); floats: the type only (Triton does not
    specialise non-constexpr floats); anything else by type and value. One loop, not a function per argument:
    5.7 instead of 8.6 us for fp8_quantize_kernel's 23 arguments and 15 constexprs on the CPU box."""
    keys = []
    for arg in args:
        kind = type(arg)
        if kind is int:
            keys.append((arg == 1, arg & 15 == 0, -_2_31 <= arg < _2_31, arg < _2_63))
        elif kind is torch.Tensor or isinstance(arg, torch.Tensor):
            keys.append((arg.dtype, arg.data_ptr() & 15 == 0))
        elif kind is float:
            keys.append(float)
        else:
            keys.append((kind, arg))
    return tuple(keys)


def _hooks_set() -> bool:
    """Whether a launch hook is registered (Triton 3.6 keeps them in HookChain objects, empty by default)."""
    return any(getattr(h, "calls", h) for h in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook))


def launch_kernel(kernel, grid: tuple, *args, **constexprs) -> None:
    """``kernel[grid](*args, **constexprs)``: the same launch, without the binding after the first call of a key.

    ``args``: the kernel's leading parameters, positional, none of them a constexpr; ``constexprs``: the rest
    by name (constexprs, and launch options such as ``num_warps``). ``grid``: 1 to 3 ints."""
    if not DIRECT or _hooks_set():
        kernel[grid](*args, **constexprs)
        return
    device = driver.active.get_current_device()
    key = (id(kernel), device, arg_keys(args), tuple((k, type(v), v) for k, v in constexprs.items()))
    entry = _compiled.get(key)
    if entry is None:
        positional_constexprs = [p.name for p in kernel.params[:len(args)] if p.is_constexpr]
        if positional_constexprs:  # arg_keys does not key them by value
            raise TypeError(f"launch_kernel: pass {kernel.__name__}'s constexprs {positional_constexprs} by name")
        compiled = kernel[grid](*args, **constexprs)
        # the parameters after the positional ones, in signature order, as JITFunction.run passes them
        trailing = tuple(constexprs[p.name] if p.name in constexprs else p.default for p in kernel.params[len(args):])
        _compiled[key] = (compiled, trailing)
        return
    compiled, trailing = entry
    grid_x, grid_y, grid_z = (*grid, 1, 1)[:3]
    compiled.run(grid_x, grid_y, grid_z, driver.active.get_current_stream(device), compiled.function,
                 compiled.packed_metadata, None, None, None, *args, *trailing)
