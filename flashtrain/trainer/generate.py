"""Sampling from the GPT with a key/value cache, ``flash_attention`` doing every attention.

``generate`` runs the prompt once (the prefill: causal attention over its T0 tokens), then one token at a time:
the new token's query (B, H, 1, D) against the cache of every key so far (B, H, t, D), ``causal=True``. The op's
causal mask is aligned bottom-right, so that single query row sees all t keys; a layer's sliding window is the
op's ``window_size=(window, 0)``, the same function ``GPT.forward`` computes. ``forward_cached`` is that forward,
built from each block's own submodules (norm1, attn.qkv, rotary, attn.proj, norm2, mlp), so ``model.py`` keeps a
single forward for training; its logits equal ``GPT.forward``'s at every position (tests/trainer/test_generate.py).

Devices and dtypes: CUDA runs the compiled kernels; a CPU runs them through Triton's interpreter
(``TRITON_INTERPRET=1`` before triton is imported), which computes float16, float32 and float64 but not bfloat16:
a bfloat16 model on the CPU is refused with a ValueError.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F

from flashtrain.ops.attention import flash_attention

from .model import GPT, apply_rotary, rotary_cos_sin


class KVCache:
    """Keys and values of every layer, preallocated: ``k[i]``, ``v[i]`` (B, H, capacity, D), with the rotary
    tables ``cos``, ``sin`` (capacity, D/2); the first ``length`` positions are filled."""

    def __init__(self, model: GPT, batch: int, capacity: int):
        c = model.config
        weight = model.wte.weight
        head_dim = c.n_embd // c.n_head
        shape = (batch, c.n_head, capacity, head_dim)
        self.k = [weight.new_zeros(shape) for _ in model.blocks]
        self.v = [weight.new_zeros(shape) for _ in model.blocks]
        # the same tables GPT.forward builds for a sequence of `capacity` tokens, row p for position p
        self.cos, self.sin = rotary_cos_sin(capacity, head_dim, c.rope_base, weight.device, weight.dtype)
        self.capacity, self.length = capacity, 0


def forward_cached(model: GPT, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits (B, T, vocab) of the tokens ``idx`` (B, T) at positions cache.length .. cache.length + T - 1, given
    the cached keys and values of the positions before; appends their keys and values and advances the cache."""
    start, T = cache.length, idx.shape[1]
    if start + T > cache.capacity:
        raise ValueError(f"forward_cached: {T} tokens at position {start} overflow the cache of "
                         f"{cache.capacity} positions")
    x = model.wte(idx)  # (B, T, C)
    cos, sin = cache.cos[start:start + T], cache.sin[start:start + T]
    for i, block in enumerate(model.blocks):
        x = x + _attention(block, block.norm1(x), cos, sin, cache.k[i], cache.v[i], start)
        x = x + block.mlp(block.norm2(x))
    cache.length = start + T
    return model.lm_head(model.norm_f(x))


def _attention(block, x, cos, sin, k_cache, v_cache, start: int) -> torch.Tensor:
    """``CausalSelfAttention.forward`` of x (B, T, C) at positions start.., against the cache (B, H, capacity, D)."""
    attn = block.attn
    B, T, C = x.shape
    q, k, v = attn.qkv(x).view(B, T, 3, attn.n_head, C // attn.n_head).unbind(2)  # each (B, T, nh, hs)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)  # rotary at the absolute positions
    end = start + T
    k_cache[:, :, start:end] = k.transpose(1, 2)
    v_cache[:, :, start:end] = v.transpose(1, 2)
    window = (-1, -1) if block.window is None else (block.window, 0)
    # bottom-right causal: query i of T sees keys j <= start + i, all `end` of them for the last one
    y = flash_attention(q.transpose(1, 2), k_cache[:, :, :end], v_cache[:, :, :end], causal=True,
                        window_size=window)  # (B, nh, T, hs)
    return attn.proj(y.transpose(1, 2).reshape(B, T, C))


def sample(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids (B,) from the logits (B, vocab): argmax at temperature 0, else a draw from
    softmax(logits / temperature) restricted to the ``top_k`` most likely tokens (all when None)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature  # float32 softmax whatever the model's dtype
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1): the k-th largest
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: GPT, prompt_ids: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, eos_id: int | None = None,
             generator: torch.Generator | None = None) -> torch.Tensor:
    """The prompts (B, T0) followed by up to ``max_new_tokens`` sampled tokens: (B, T0 + n), n <= max_new_tokens.

    temperature: 0 for greedy decoding (argmax), else the softmax temperature; top_k: sample among the k most
    likely tokens (None: all); generator: a ``torch.Generator`` on the model's device, for reproducible draws.
    eos_id: a row that samples it is finished: its later positions hold eos_id (padding), and generation stops
    early once every row has finished. ``prompt_ids`` move to the model's device; the result is on it.
    """
    _check_arguments(model, prompt_ids, max_new_tokens, temperature, top_k, eos_id)
    ids = prompt_ids.to(model.wte.weight.device, torch.long)
    batch, prompt_len = ids.shape
    if max_new_tokens == 0:
        return ids
    cache = KVCache(model, batch, prompt_len + max_new_tokens)
    logits = forward_cached(model, ids, cache)[:, -1]  # the prefill: (B, vocab) after the last prompt token
    finished = torch.zeros(batch, dtype=torch.bool, device=ids.device)
    out = [ids]
    for step in range(max_new_tokens):
        token = sample(logits, temperature, top_k, generator)  # (B,)
        if eos_id is not None:
            token = token.masked_fill(finished, eos_id)  # finished rows pad with eos_id
            finished |= token == eos_id
        out.append(token[:, None])
        if step == max_new_tokens - 1 or (eos_id is not None and bool(finished.all())):
            break
        logits = forward_cached(model, token[:, None], cache)[:, -1]
    return torch.cat(out, dim=1)


def _check_arguments(model, prompt_ids, max_new_tokens, temperature, top_k, eos_id) -> None:
    """Each argument of ``generate`` checked before any kernel runs; the error names it, its value and what was
    expected."""
    vocab = model.config.vocab_size
    if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dim() != 2 or prompt_ids.shape[1] < 1:
        shape = tuple(prompt_ids.shape) if isinstance(prompt_ids, torch.Tensor) else type(prompt_ids).__name__
        raise ValueError(f"generate: prompt_ids has shape {shape}; expected a (batch, T0) tensor with T0 >= 1")
    if prompt_ids.is_floating_point() or prompt_ids.is_complex() or prompt_ids.dtype == torch.bool:
        raise ValueError(f"generate: prompt_ids has dtype {prompt_ids.dtype}; expected integer token ids")
    if prompt_ids.numel() and not (0 <= int(prompt_ids.min()) and int(prompt_ids.max()) < vocab):
        raise ValueError(f"generate: prompt_ids holds ids in [{int(prompt_ids.min())}, {int(prompt_ids.max())}]; "
                         f"expected ids in [0, {vocab})")
    if not _is_int(max_new_tokens) or max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens!r}; expected an int >= 0")
    if (not isinstance(temperature, numbers.Real) or isinstance(temperature, bool) or not math.isfinite(temperature)
            or temperature < 0):
        raise ValueError(f"generate: temperature={temperature!r}; expected a finite number >= 0 (0: greedy)")
    if top_k is not None and (not _is_int(top_k) or top_k < 1):
        raise ValueError(f"generate: top_k={top_k!r}; expected None or an int >= 1")
    if eos_id is not None and (not _is_int(eos_id) or not 0 <= eos_id < vocab):
        raise ValueError(f"generate: eos_id={eos_id!r}; expected None or an id in [0, {vocab})")
    weight = model.wte.weight
    if weight.device.type == "cpu" and weight.dtype == torch.bfloat16:
        raise ValueError(f"generate: the model's dtype is {weight.dtype} on the CPU; Triton's interpreter computes "
                         "float16, float32 and float64 only: load the model with dtype=torch.float32")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
