"""Bad input raises a clear error, naming the argument, its value and what was expected, before launch."""

import pytest
import torch

from flashtrain import flash_attention


def qkv(q_shape=(1, 4, 8, 16), kv_shape=(1, 2, 8, 16), dtype=torch.float32):
    return (torch.randn(q_shape).to(dtype), torch.randn(kv_shape).to(dtype), torch.randn(kv_shape).to(dtype))


@pytest.mark.parametrize("args, kwargs, error, words", [
    (qkv((4, 8, 16), (1, 2, 8, 16)), {}, ValueError, ["q must be 4-D", "(4, 8, 16)"]),
    (qkv((1, 4, 8, 16), (1, 2, 8, 24)), {}, ValueError, ["head dims differ", "(1, 2, 8, 24)"]),
    (qkv((2, 4, 8, 16), (1, 2, 8, 16)), {}, ValueError, ["batch sizes differ", "(2, 4, 8, 16)"]),
    (qkv((1, 4, 8, 16), (1, 3, 8, 16)), {}, ValueError, ["heads_q=4", "heads_kv=3", "multiple"]),
    (qkv((1, 4, 8, 300), (1, 2, 8, 300)), {}, ValueError, ["head_dim=300", "1..256"]),
    (qkv(dtype=torch.int32), {}, TypeError, ["q has dtype torch.int32", "float16"]),
    ((torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16, dtype=torch.float64), torch.randn(1, 2, 8, 16)), {},
     TypeError, ["share one dtype", "k torch.float64"]),
    ((torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 9, 16)), {},
     ValueError, ["(heads_kv, seq_k)", "(1, 2, 9, 16)"]),
    (qkv(), {"scale": float("nan")}, ValueError, ["scale", "nan"]),
    (qkv(), {"causal": "yes"}, TypeError, ["causal", "'yes'"]),
    (([1.0], *qkv()[1:]), {}, TypeError, ["q must be a torch.Tensor", "list"]),
])
def test_bad_input(args, kwargs, error, words):
    with pytest.raises(error) as info:
        flash_attention(*args, **kwargs)
    for w in words:
        assert w in str(info.value), f"{w!r} not in {str(info.value)!r}"


def test_mixed_devices():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="one device"):
        flash_attention(q, k.to("meta"), v)


@pytest.mark.parametrize("kwargs, error, words", [
    ({"key_padding_mask": torch.zeros(1, 8, dtype=torch.int64)}, TypeError,
     ["key_padding_mask must be a bool tensor", "torch.int64"]),
    ({"key_padding_mask": torch.zeros(1, 8, requires_grad=True)}, ValueError, ["key_padding_mask requires grad"]),
    ({"key_padding_mask": torch.zeros(1, 9, dtype=torch.bool)}, ValueError, ["(1, 9)", "(batch, seq_k) = (1, 8)"]),
    ({"key_padding_mask": torch.zeros(2, 8, dtype=torch.bool)}, ValueError, ["(2, 8)", "(1, 8)"]),
    ({"dropout_p": 1.0}, ValueError, ["dropout_p", "[0, 1)", "1.0"]),
    ({"dropout_p": -0.1}, ValueError, ["dropout_p", "-0.1"]),
    ({"dropout_p": True}, ValueError, ["dropout_p", "True"]),
])
def test_bad_padding_or_dropout(kwargs, error, words):
    with pytest.raises(error) as info:
        flash_attention(*qkv(), **kwargs)
    for w in words:
        assert w in str(info.value), f"{w!r} not in {str(info.value)!r}"


@pytest.mark.interpreter
@pytest.mark.parametrize("fp8", [None, "forward"])
def test_bfloat16_on_the_cpu_is_refused(fp8, poison_allocations):
    """Triton's interpreter has no bfloat16 arithmetic (a bf16 dot multiplies raw bit patterns): CPU bf16 inputs
    raise a TypeError naming the dtype and the device before any kernel runs, never a wrong number."""
    with pytest.raises(TypeError) as info:
        flash_attention(*qkv(dtype=torch.bfloat16), fp8=fp8)
    for w in ("torch.bfloat16", "device cpu", "float16, float32 or float64"):
        assert w in str(info.value), f"{w!r} not in {str(info.value)!r}"
    out = flash_attention(*qkv(dtype=torch.float16))  # the same call in float16 runs
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
