"""Context parallelism: one sequence across the ranks of a process group.

* ``shard_sequence`` / ``unshard_sequence``: the load-balanced layout (rank r holds chunks r and 2P-1-r of 2P);
* ``ring_attention``: exact attention over the full sequence from every rank's shards, keys and values passed
  around the ring, partial results merged through the LSE; differentiable.
"""

from .layout import positions, shard_sequence, unshard_sequence
from .ring import ring_attention

__all__ = ["ring_attention", "shard_sequence", "unshard_sequence", "positions"]
