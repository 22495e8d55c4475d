"""Which kernel runs, decided on the host: the modes, the rules a CPU machine can check, the per-GPU thresholds.
The gpu tests (tests/ops/test_gpu.py) run every Hopper kernel where ``dispatch`` sends inputs to it."""

import pytest
import torch

from flashtrain.kernels import hopper
from flashtrain.kernels.attention import tiles as attention_tiles
from flashtrain.kernels.tuning import forced_configs
from flashtrain.ops import dispatch


def test_hopper_forward_modes():
    assert dispatch.hopper_forward_mode() == "auto"
    with dispatch.hopper_forward("never"):
        assert dispatch.hopper_forward_mode() == "never"
    assert dispatch.hopper_forward_mode() == "auto"
    with pytest.raises(ValueError, match="hopper_forward: mode='sometimes'"):
        with dispatch.hopper_forward("sometimes"):
            pass


def test_hopper_backward_modes():
    assert dispatch.hopper_backward_mode() == "auto"
    with dispatch.hopper_backward("always"):
        assert dispatch.hopper_backward_mode() == "always"
        assert dispatch.hopper_forward_mode() == "auto"  # the two switches are apart
    assert dispatch.hopper_backward_mode() == "auto"
    with pytest.raises(ValueError, match="hopper_backward: mode='sometimes'"):
        with dispatch.hopper_backward("sometimes"):
            pass


def test_cpu_tensors_take_the_triton_kernels_even_forced():
    """CPU tensors never take a Hopper kernel, whatever the mode, and the choice says why."""
    q = torch.randn(1, 2, 16384, 64, dtype=torch.bfloat16)
    with dispatch.hopper_forward("always"), dispatch.hopper_backward("always"):
        choices = [dispatch.forward(q, q, q, True, 0.125, None, 0.0), dispatch.backward(q, q, q, q, True, None, 0.0),
                   dispatch.fp8_forward(q, q, 64, True, 0.125)]
    for choice in choices:
        assert choice == (dispatch.TRITON, "not on a CUDA GPU")


def test_rules_before_the_device():
    """The input rules each Hopper kernel has, checked before anything about the device: each reason names the
    rule that sent the inputs to the Triton kernels."""
    q = torch.randn(1, 2, 64, 64, dtype=torch.float16)
    with dispatch.hopper_forward("never"):
        assert dispatch.forward(q, q, q, False, 0.1, None, 0.0).reason == "Hopper kernels switched off (mode 'never')"
    with dispatch.hopper_backward("never"):
        assert "switched off" in dispatch.backward(q, q, q, q, False, None, 0.0).reason
    torch.use_deterministic_algorithms(True)
    try:
        with dispatch.hopper_backward("always"):
            choice = dispatch.backward(q, q, q, q, False, None, 0.0)
    finally:
        torch.use_deterministic_algorithms(False)
    assert choice.kernel == dispatch.TRITON and "deterministic" in choice.reason


class _CudaLike:
    """Stands in for a CUDA tensor where only ``is_cuda`` and ``dtype`` are read."""
    is_cuda = True

    def __init__(self, dtype):
        self.dtype = dtype


def test_input_rules_of_the_16bit_hopper_kernels(monkeypatch):
    """A forced Triton tile (tests check every candidate) must run that Triton kernel, not the Hopper one; the
    Hopper kernels take float16 / bfloat16 without masks, dropout, windows or packed sequences."""
    monkeypatch.setattr(dispatch, "INTERPRET", False)
    fake_cuda = _CudaLike(torch.float16)
    dense = ((-1, -1), False)
    with forced_configs(fwd=attention_tiles.FWD_CANDIDATES[0]):
        reason = dispatch._not_16bit_hopper("always", fake_cuda, None, 0.0, ("fwd",), *dense)
    assert reason == "a Triton config is forced"
    assert dispatch._not_16bit_hopper("always", fake_cuda, None, 0.0, ("fwd",), *dense) is None
    assert "float16 or bfloat16" in dispatch._not_16bit_hopper("always", _CudaLike(torch.float32), None, 0.0,
                                                               ("fwd",), *dense)
    assert "key padding" in dispatch._not_16bit_hopper("always", fake_cuda, torch.zeros(1, 64), 0.0, ("fwd",), *dense)
    assert "dropout" in dispatch._not_16bit_hopper("always", fake_cuda, None, 0.1, ("fwd",), *dense)
    for window, varlen in (((8, 0), False), ((-1, -1), True)):
        assert "sliding window or packed" in dispatch._not_16bit_hopper("always", fake_cuda, None, 0.0, ("fwd",),
                                                                       window, varlen)


def test_thresholds_per_gpu(monkeypatch):
    """The "auto" thresholds are read for the GPU at hand: shorter sequences than its table's keep Triton; a GPU
    without a table is left to the device rules (only sm_90 runs the Hopper kernels)."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(dispatch, "device_capability", lambda device: dispatch.SM90)
    table = dispatch.HOPPER_FWD_MIN_SEQ
    min_seq = table[dispatch.SM90][(128, True)]
    assert dispatch._too_short(table, cuda, (128, True), min_seq - 1)
    assert not dispatch._too_short(table, cuda, (128, True), min_seq)
    assert dispatch._too_short(table, cuda, (96, True), 10**6)  # no threshold: never faster
    monkeypatch.setattr(dispatch, "device_capability", lambda device: (8, 0))
    assert not dispatch._too_short(table, cuda, (128, True), 1)


def test_tma_rules():
    """TMA reads per-(batch, head) tiles with unit stride on head_dim, 16-byte aligned starts and rows."""
    q = torch.randn(1, 2, 300, 64, dtype=torch.bfloat16)
    assert hopper.tma_addressable(q)
    assert hopper.tma_addressable(torch.randn(1, 300, 2, 64).to(torch.bfloat16).transpose(1, 2))
    assert not hopper.tma_addressable(q.transpose(2, 3))  # head_dim not the unit-stride dim
    assert not hopper.tma_addressable(torch.randn(1, 2, 300, 72, dtype=torch.bfloat16)[..., 4:68])  # 8-byte offset
    assert not hopper.tma_addressable(torch.randn(1, 2, 300, 68, dtype=torch.bfloat16)[..., :64])  # 136-byte rows


def test_explain():
    q = torch.randn(1, 2, 8, 16, dtype=torch.float16)
    text = dispatch.explain(q, q, q, causal=True)
    assert text == "forward: triton (not on a CUDA GPU)\nbackward: triton (not on a CUDA GPU)"


def test_split_dkdv_modes():
    """The split dK/dV launches run where the mode says: "always" anywhere (CPU included), "auto" only on a GPU
    with a measured threshold (none on CPU), "never" nowhere; a bad mode names the switch."""
    q = torch.randn(1, 2, 64, 256, dtype=torch.float16)
    assert dispatch.backward(q, q, q, q, True, None, 0.0).kernel == dispatch.TRITON
    with dispatch.split_dkdv("always"):
        assert dispatch.backward(q, q, q, q, True, None, 0.0).kernel == dispatch.TRITON_SPLIT
        with dispatch.split_dkdv("never"):
            assert dispatch.backward(q, q, q, q, True, None, 0.0).kernel == dispatch.TRITON
    with pytest.raises(ValueError, match="split_dkdv: mode='yes'"):
        with dispatch.split_dkdv("yes"):
            pass
