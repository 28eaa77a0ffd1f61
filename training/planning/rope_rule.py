"""The RoPE base a ramp stage of a given length gets (`--plan-ramp`): the written rule and its source.

Men et al. 2024, "Base of RoPE Bounds Context Length" (arXiv 2405.14591), derive an absolute lower bound of the RoPE
base for a context length L (below it the model keeps a low perplexity but cannot retrieve from far away) and fit
their bound as base >= 0.0424 * L^1.628 (their Figure 1). The rule here:

    theta(stage) = max(theta of the previous stage, the next 1/2/5 x 10^k at or above 0.0424 * L^1.628)

so a stage never trains below the bound, the base never decreases along the ramp, and short stages keep the
pretrained base when it is already above the bound (Llama 3's 500K up to ~22K tokens). ProLong (Gao et al. 2024)
trained Llama 3 8B with 8M at 64K and 128M at 512K; the rule gives 5M and 100M (bounds 2.9M and 87M). The Llama
3.1 frequency scaling of the base recipe is kept as it is.
"""
from __future__ import annotations

import math

MEN_COEFFICIENT, MEN_EXPONENT = 0.0424, 1.628
ROPE_RULE_SOURCE = ("RoPE theta = max(previous stage's, next 1/2/5x10^k >= 0.0424 * seq_len^1.628), the lower bound "
                    "of the base for a context length fitted by Men et al. 2024, 'Base of RoPE Bounds Context "
                    "Length' (arXiv 2405.14591, Fig. 1); ProLong used 8M at 64K and 128M at 512K")


def men_lower_bound(seq_len: int) -> float:
    """Men et al. 2024's fitted lower bound of the RoPE base for a context of `seq_len` tokens."""
    return MEN_COEFFICIENT * seq_len ** MEN_EXPONENT


def round_up_125(value: float) -> float:
    """The smallest number of the form {1, 2, 5} x 10^k that is >= value (a base people can read and compare)."""
    scale = 10 ** math.floor(math.log10(value))
    return next(float(m * scale) for m in (1, 2, 5, 10) if m * scale >= value * (1 - 1e-12))


def stage_rope_theta(seq_len: int, previous_theta: float) -> float:
    """The base of a stage of `seq_len` tokens after a stage (or the pretrained model) that used `previous_theta`."""
    return max(previous_theta, round_up_125(men_lower_bound(seq_len)))
