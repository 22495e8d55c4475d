"""Test setup: the kernels run compiled on a CUDA machine and through Triton's interpreter elsewhere.

TRITON_INTERPRET must be set before triton is first imported, so this runs before any test module
imports flashtrain. `device` is the device the kernel tests run on: cuda when there is one, else cpu. Tests that
run the kernels on CPU tensors whatever the machine (modules and trainer runs against PyTorch on the CPU) carry the
`interpreter` marker and are skipped where the interpreter is off, as on a GPU machine.
"""

import os
import tempfile

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# torch.compile's on-disk caches key a graph on the custom ops it calls, not on their autograd formulas: after
# a change to a backward (say, which tensors the FP8 forward saves), a cached compiled graph still calls the
# old one. Each pytest run compiles into a fresh directory instead (CI starts empty anyway).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="flashtrain-tests-inductor-"))

import pytest  # noqa: E402

from flashtrain.kernels.launch import INTERPRET, clear_kept  # noqa: E402  (INTERPRET: the kernels' own reading)

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_interpreter = pytest.mark.skip(reason="runs the kernels on CPU tensors, which needs Triton's interpreter "
                                               "(TRITON_INTERPRET=1: set by this conftest where there is no GPU)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "interpreter" in item.keywords and not INTERPRET:
            item.add_marker(skip_interpreter)


@pytest.fixture(autouse=True)
def fresh_launch_plans():
    """Each test builds the launchers' kept plans anew and leaves none behind: a plan holds the module constants of
    its time, and tests change them (monkeypatch undoes the change before this fixture's teardown)."""
    clear_kept()
    yield
    clear_kept()


@pytest.fixture(autouse=True)
def release_cached_gpu_memory():
    """Return the caching allocator's free blocks after each test: pytest-xdist workers share one GPU, and a worker
    that ran a 16k-token test would otherwise hold its 20+ GiB through every later test."""
    yield
    if HAS_CUDA:
        torch.cuda.empty_cache()


@pytest.fixture
def device():
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def poison_allocations(monkeypatch):
    """Make torch.empty / torch.empty_like return NaN-filled tensors, so any element a kernel fails to
    write shows up as NaN in its output."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poisoned(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: poisoned(real_empty(*a, **kw)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **kw: poisoned(real_empty_like(*a, **kw)))
