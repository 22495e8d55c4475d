"""The LSE's two domains. The kernels keep the logsumexp of each row's scaled scores in the log2 domain (their
exponentials are ``exp2``); ``flash_attention`` returns it in natural log. These convert values and gradients."""

from __future__ import annotations

import math

from torch import Tensor

from flashtrain.kernels.common import LOG2E

LN2 = math.log(2.0)


def natural_lse(lse2: Tensor) -> Tensor:
    """The natural-log LSE, float32, from the kernels' log2-domain one (the multiply runs in lse2's precision)."""
    return (lse2 * LN2).float()


def kernel_dlse(dlse2: Tensor | None) -> Tensor | None:
    """The gradient of the ops' log2-domain LSE output as the backward kernels take it: the gradient of the
    natural-log LSE (None when the LSE was not used)."""
    return None if dlse2 is None else dlse2 * LOG2E
