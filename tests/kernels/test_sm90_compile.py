"""Every kernel compiles for the H200's architecture (sm_90), on any machine: Triton compiles ahead of time
for a named target, so a kernel the GPU would reject fails here, in CI, before device time is spent.

Runs scripts/dev/compile_kernels.py --quick in a subprocess, because this process may have TRITON_INTERPRET=1
set (conftest.py), which replaces kernels by Python functions.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "dev" / "compile_kernels.py"


def _compile_kernels(*args: str) -> subprocess.CompletedProcess:
    """Run scripts/dev/compile_kernels.py with ``args`` outside the interpreter; assert that it succeeded."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True,
                            timeout=1200)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def test_every_kernel_compiles_for_sm90_with_its_wgmmas_pipelined():
    """One compile of every kernel (one tuning candidate each), ptxas run again on the FP8 ones for their wgmma
    warnings:

    - every kernel compiles;
    - where ``fp8_tiles.FP8_BWD_SETTLE_DK`` settles dK within the step, ptxas does not serialise the FP8 dK/dV
      kernel's wgmmas (warning C7515, every wgmma waiting for the one before); at head_dim 128, which keeps the
      serialised kernel (faster there, docs/tuning.md), it still does;
    - the FP8 Hopper forward rounds P into its packed registers only after the previous P V's wgmma has completed;
      rounded earlier, ptxas serialises every wgmma of the kernel (C7513)."""
    from flashtrain.kernels.fp8 import tiles as fp8_tiles

    result = _compile_kernels("--quick", "--wgmma-warnings", "fp8 dkdv", "fp8 fwd hopper")
    assert "kernels compiled for sm_90" in result.stdout
    warnings = [line for line in result.stdout.splitlines() if line.startswith("WGMMA")]
    serialised = {int(line.split("D=")[1].split()[0]) for line in warnings
                  if line.startswith("WGMMA fp8 dkdv") and "C7515" in line}
    assert serialised == {d for d, settle in fp8_tiles.FP8_BWD_SETTLE_DK.items() if not settle}, warnings
    assert not [line for line in warnings if line.startswith("WGMMA fp8 fwd hopper")], warnings
    assert len([line for line in result.stdout.splitlines() if line.startswith("FAILED")]) == 0
