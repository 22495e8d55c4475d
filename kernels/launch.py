"""Kernel launches that skip Triton's per-call argument binding once a specialisation has been compiled, and the
device helpers every launcher uses.

``kernel[grid](*args, **constexprs)`` binds and specialises every argument on every call before the compiled
kernel's launcher runs: 37 us a launch of ``fp8_quantize_kernel`` (23 arguments, 15 constexprs) on an H200 host,
of which the compiled launcher took 10. ``launch_kernel`` keeps, per kernel and per key of its arguments, the
compiled kernel the first JIT launch returned, and later calls its launcher directly: 9-14 us less host time per
bf16 forward, 155-237 us per bf16 forward + backward (``scripts/bench/host_time.py``, both paths in alternating
rounds of one process).

``FixedLaunch`` goes further for launchers that keep a launch per shape (``kept``): its scalar arguments and
constexprs are fixed when it is made, so a call passes only the tensors and looks the compiled kernel up by their
dtypes and alignments (the FP8 forward's quantisation, mean, rotation and Hopper launches).

The key holds everything Triton 3.6 specialises a kernel on, or finer (``arg_keys``), so two calls with one key
compile to the same kernel. Only Triton 3.6's launcher contract has been read (``JITFunction.run``,
``CompiledKernel.run``): other versions, Triton's interpreter, and launches with a launch hook set (profilers
read the hook's metadata) take the JIT path.
"""

from __future__ import annotations

import contextlib
import functools
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


def launch_device(t: torch.Tensor):
    """A context in which kernels launch on ``t``'s GPU. Triton launches on the current CUDA device, whatever
    device the tensors are on: with cuda:0 current and tensors on cuda:1, the Hopper kernels' launches raise
    ("Pointer argument ... cannot be accessed from Triton") and others may run on cuda:0's stream, out of order
    with cuda:1's work. A no-op for CPU tensors and when that device is already current."""
    return torch.cuda.device(t.device) if _on_another_gpu(t) else contextlib.nullcontext()


def _on_another_gpu(t: torch.Tensor) -> bool:
    """Whether ``t`` is on a CUDA device other than the current one."""
    return t.is_cuda and t.device.index != torch.cuda.current_device()


def on_input_device(launcher):
    """Decorator for a launcher: run it in ``launch_device`` of its first tensor argument."""
    @functools.wraps(launcher)
    def launch_on_input_device(*args, **kwargs):
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is None or not _on_another_gpu(first):  # no context manager on the common path (host time)
            return launcher(*args, **kwargs)
        with torch.cuda.device(first.device):
            return launcher(*args, **kwargs)
    return launch_on_input_device


def device_capability(device: torch.device) -> tuple[int, int]:
    """``torch.cuda.get_device_capability(device)``, asked once per device in eager calls (the query costs a few
    microseconds of host time). Under torch.compile it is asked directly: Dynamo folds it into a constant, and it
    warns about a ``functools.cache`` wrapper it traces through."""
    if torch.compiler.is_compiling():
        return torch.cuda.get_device_capability(device)
    return _cached_capability(device)


@functools.cache
def _cached_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@functools.cache
def sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors, asked once per device."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def arg_keys(args: tuple) -> tuple:
    """Per launch argument, what Triton's specialisation of it depends on, or finer. Tensors: the dtype and whether
    the address is 16-byte aligned; integers: whether one, whether a multiple of 16, and the 32/64-bit range (so
    sequence lengths, strides and seeds that change do not add keys); floats: the type only (Triton does not
    specialise non-constexpr floats); anything else by type and value. One loop, not a function per argument:
    5.7 instead of 8.6 us for fp8_quantize_kernel's 23 arguments and 15 constexprs."""
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
        _compiled[key] = (kernel[grid](*args, **constexprs), _trailing(kernel, len(args), constexprs))
        return
    compiled, trailing = entry
    _run_compiled(compiled, (*grid, 1, 1)[:3], device, *args, *trailing)


def _trailing(kernel, start: int, constexprs: dict) -> tuple:
    """The values of ``kernel``'s parameters from index ``start`` on (its constexprs), in signature order, as Triton
    3.6's JITFunction.run passes them to the compiled launcher: the one given by name, else the default."""
    return tuple(constexprs[p.name] if p.name in constexprs else p.default for p in kernel.params[start:])


def _run_compiled(compiled, grid: tuple, device, *args) -> None:
    """The compiled kernel's own launcher on the current stream of ``device``; ``grid`` 3 ints, ``args`` every
    parameter's value in signature order (the launch's, then ``_trailing``'s)."""
    compiled.run(*grid, driver.active.get_current_stream(device), compiled.function, compiled.packed_metadata,
                 None, None, None, *args)


class FixedLaunch:
    """``kernel[grid](*tensors, *scalars, **constexprs)`` with everything but the tensors fixed when it is made.

    For a launcher that keeps one per shape (``kept``, keyed by the shapes, strides, dtypes and flags its scalars
    and constexprs come from): then Triton 3.6's specialisation varies only with the tensors'
    dtypes and 16-byte alignment, and a call looks the compiled kernel up by those, without ``launch_kernel``'s
    keying of every argument (~6 us of host time for 26 of them) or its constexprs. The kernel's
    parameters: the tensors first, then the scalars, then the constexprs (by name, and launch options such as
    ``num_warps``). Takes the JIT path where ``launch_kernel`` does (other Triton versions, the interpreter, a
    launch hook set)."""

    __slots__ = ("kernel", "grid", "scalars", "constexprs", "tensor_count", "trailing", "compiled")

    def __init__(self, kernel, grid: tuple, scalars: tuple, constexprs: dict):
        self.kernel, self.grid = kernel, (*grid, 1, 1)[:3]
        self.scalars, self.constexprs = tuple(scalars), dict(constexprs)
        self.compiled: dict = {}  # (device, (dtype, aligned) per tensor) -> compiled kernel
        self.tensor_count, self.trailing = None, ()
        if not DIRECT:  # the JIT launch every call (an interpreted kernel has no parameter list to read)
            return
        params = kernel.params
        first = next(i for i, p in enumerate(params) if p.is_constexpr)
        wrong = [p.name for p in params[first:] if not p.is_constexpr or not (p.name in constexprs or p.has_default)]
        if wrong or first < len(self.scalars):
            raise TypeError(f"FixedLaunch: {kernel.__name__} takes its tensors, {len(self.scalars)} scalars, then "
                            f"constexprs by name; parameters {wrong} are not constexprs given or defaulted")
        self.tensor_count = first - len(self.scalars)
        self.trailing = _trailing(kernel, first, constexprs)

    def __call__(self, *tensors: torch.Tensor) -> None:
        if not DIRECT or _hooks_set():
            self.kernel[self.grid](*tensors, *self.scalars, **self.constexprs)
            return
        device = driver.active.get_current_device()
        key = (device, *[(t.dtype, t.data_ptr() & 15 == 0) for t in tensors])
        compiled = self.compiled.get(key)
        if compiled is None:
            if len(tensors) != self.tensor_count:
                raise TypeError(f"FixedLaunch: {self.kernel.__name__} takes {self.tensor_count} tensors; got "
                                f"{len(tensors)}")
            self.compiled[key] = self.kernel[self.grid](*tensors, *self.scalars, **self.constexprs)
            return
        _run_compiled(compiled, self.grid, device, *tensors, *self.scalars, *self.trailing)


_KEPT: list = []


def kept(fn):
    """``functools.lru_cache(maxsize=512)`` for a launcher's per-signature plan (the ``FixedLaunch`` and what else it
    works out from shapes), registered for ``clear_kept``: a plan holds what its module's tuning constants said when
    it was made, so a change to them (tests) must clear the plans to take effect."""
    cached = functools.lru_cache(maxsize=512)(fn)
    _KEPT.append(cached)
    return cached


def clear_kept() -> None:
    """Forget every ``kept`` plan (they are rebuilt on the next call, from the module constants of that time)."""
    for cached in _KEPT:
        cached.cache_clear()
