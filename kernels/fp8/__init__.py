"""The FP8 path's kernels: ``quant`` (per-tile e4m3), ``hadamard``, ``centring``, ``fwd``, ``bwd``, ``tiles``."""
