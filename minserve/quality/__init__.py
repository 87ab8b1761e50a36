"""How good a model's predictions are, measured: held-out text and perplexity on it, and whether a sampler's
output follows the distribution it should (a chi-square test).

Chapter 07 compares a quantized model with the full-precision one on these numbers; chapter 01 and
``minserve perplexity`` report them for any checkpoint the engine loads.
"""

from minserve.quality.distribution import (
    ChiSquareResult,
    chi_square_quantile,
    chi_square_test,
    chi_square_two_sample,
)
from minserve.quality.held_out import held_out_text
from minserve.quality.perplexity import PerplexityResult, perplexity

__all__ = [
    "ChiSquareResult",
    "PerplexityResult",
    "chi_square_quantile",
    "chi_square_test",
    "chi_square_two_sample",
    "held_out_text",
    "perplexity",
]
