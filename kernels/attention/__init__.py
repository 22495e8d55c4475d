"""The 16-bit Triton attention kernels: ``fwd``, ``bwd``, their ``tiles``, and the materialised ``dropout_mask``."""
