"""Hydra/OmegaConf helpers: sequence-length parsing and the resolvers the configs in conf/ use."""

from __future__ import annotations

import re

from omegaconf import OmegaConf

_SUFFIX = {"": 1, "k": 1024, "m": 1024**2}
_TOKENS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*$")


def parse_tokens(value) -> int:
    """A token count from 16384, "16384", "16k" (x1024) or "1M" (x1024^2); ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"seq_len={value!r}: expected a positive token count such as 4096, '16k' or '1M'")
    if isinstance(value, int):
        number = value
    else:
        match = _TOKENS.match(str(value))
        if not match:
            raise ValueError(f"seq_len={value!r}: expected a positive token count such as 4096, '16k' or '1M'")
        scaled = float(match.group(1)) * _SUFFIX[match.group(2).lower()]
        if scaled != int(scaled):
            raise ValueError(f"seq_len={value!r} is not a whole number of tokens ({scaled})")
        number = int(scaled)
    if number < 1:
        raise ValueError(f"seq_len={value!r}: must be at least 1 token")
    return number


def batch_for(tokens_per_step, seq_len) -> int:
    """Sequences per step for a fixed token budget: tokens_per_step // seq_len, at least 1."""
    return max(1, parse_tokens(tokens_per_step) // parse_tokens(seq_len))


def register_resolvers() -> None:
    """${tokens:16k} -> 16384; ${batch_for:32k,${seq_len}} -> sequences per step."""
    OmegaConf.register_new_resolver("tokens", parse_tokens, replace=True)
    OmegaConf.register_new_resolver("batch_for", batch_for, replace=True)
