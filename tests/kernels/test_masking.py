"""Where masks cut the work, on the host: the causal launch sections (no kernel runs)."""

import torch

from flashtrain.kernels import masking


def test_causal_sections(monkeypatch):
    """Launch sections of a causal kernel: of at least one program per SM, more pairs while the rows they stream
    (the forward's and dQ's K and V, dK/dV's Q and dO) fit CAUSAL_SECTION_KV_BYTES, a power of two pairs; at least
    1 section; 1 without a mask; the override wins."""
    gpu = torch.device("cuda")  # only its type is read: the SM count is stubbed
    monkeypatch.setattr(masking, "sm_count", lambda device: 132)
    monkeypatch.setattr(masking, "CAUSAL_SECTIONS", None)
    sections = masking.causal_sections
    assert sections(False, 32, 32, 1, 4096, 512, gpu) == 1
    # FP8 at head_dim 256, (4, 8, 4096): 32 programs a pair -> 5 pairs for 132 SMs (2 MiB of K and V a pair -> 4),
    # rounded up to 8: 4 sections
    assert sections(True, 32, 32, 1, 4096, 512, gpu) == 4
    # 16-bit at head_dim 128, (1, 16, 16384), 192-row programs: 86 a pair -> 2; 8 MiB a pair -> 1
    assert sections(True, 16, 86, 1, 16384, 512, gpu) == 8
    # FP8 at 128, (4, 16, 4096): 22 a pair -> 6; 1 MiB a pair -> 8; with 4 query heads a KV head -> 32
    assert sections(True, 64, 22, 1, 4096, 256, gpu) == 8
    assert sections(True, 64, 22, 4, 4096, 256, gpu) == 2
    assert sections(True, 4, 22, 1, 4096, 256, gpu) == 1  # never fewer than one
    assert sections(True, 15, 32, 1, 4096, 512, gpu) == 1  # 15 pairs by 8: one section of 15
    assert sections(True, 24, 32, 1, 4096, 512, gpu) == 3
    assert sections(True, 4, 1, 1, 1 << 30, 256, torch.device("cpu")) == 4  # one SM: a pair a section
    # bf16 dK/dV at 128, (4, 16, 4096), 128-key blocks: 32 a pair -> 5; Q and dO with LSE and delta, 520 bytes a
    # query row: 2 pairs in 8 MiB -> 8 a section
    assert sections(True, 64, 32, 1, 4096, 520, gpu) == 8
    # with 4 query heads a KV head, a pair streams 4 heads' rows: 16 KV pairs of 32 -> 8 a section
    assert sections(True, 16, 32, 1, 4096, 4 * 520, gpu) == 2
    monkeypatch.setattr(masking, "CAUSAL_SECTIONS", 3)
    assert sections(True, 64, 22, 1, 4096, 256, gpu) == 3 and sections(True, 2, 22, 1, 4096, 256, gpu) == 2
