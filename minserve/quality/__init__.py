"""How good a model's predictions are, measured: held-out text and perplexity on it.

Chapter 07 compares a quantized model with the full-precision one on these numbers; chapter 01 and
``minserve perplexity`` report them for any checkpoint the engine loads.
"""

from minserve.quality.held_out import held_out_text
from minserve.quality.perplexity import PerplexityResult, perplexity

__all__ = ["PerplexityResult", "held_out_text", "perplexity"]
