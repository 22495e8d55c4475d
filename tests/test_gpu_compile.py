"""Every kernel compiles for the H200's architecture (sm_90), on any machine: Triton compiles ahead of time
for a named target, so a kernel the GPU box would reject fails here, in CI, before device time is spent.

Runs scripts/compile_kernels.py --quick in a subprocess, because this process may have TRITON_INTERPRET=1
set (conftest.py), which replaces kernels by Python functions.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "compile_kernels.py"


def _compile_kernels(*args: str) -> subprocess.CompletedProcess:
    """Run scripts/compile_kernels.py with ``args`` outside the interpreter; assert that it succeeded."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True,
                            timeout=1200)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return result


def test_every_kernel_compiles_for_sm90():
    result = _compile_kernels("--quick")
    assert "kernels compiled for sm_90" in result.stdout


def test_fp8_dkdv_wgmmas_pipelined_where_settled():
    """Where ``configs.FP8_BWD_SETTLE_DK`` settles dK within the step, ptxas must not serialise the FP8 dK/dV
    kernel's wgmmas (warning C7515, every wgmma waiting for the one before); at head_dim 128, which keeps the
    serialised kernel (faster there, benchmarks/NOTES.md), it still does, which this test also checks."""
    from flashtrain.kernels import configs
    result = _compile_kernels("--only", "fp8 dkdv", "--wgmma-warnings")
    serialised = {int(line.split("D=")[1].split()[0]) for line in result.stdout.splitlines()
                  if line.startswith("WGMMA") and "C7515" in line}
    assert serialised == {d for d, settle in configs.FP8_BWD_SETTLE_DK.items() if not settle}, result.stdout[-4000:]


def test_fp8_hopper_forward_wgmmas_pipelined():
    """The FP8 Hopper forward rounds P into its packed registers only after the previous P V's wgmma has
    completed; rounded earlier, ptxas serialises every wgmma of the kernel (C7513, benchmarks/NOTES.md)."""
    result = _compile_kernels("--only", "fp8 fwd hopper", "--wgmma-warnings")
    assert "4/4 kernels compiled" in result.stdout and "WGMMA" not in result.stdout, result.stdout[-4000:]
