"""Chapter 07: narrow number formats for weights, the linear layers that compute with them, and the swap
that quantizes a loaded model.

* :mod:`.formats`: int8 per channel, int4 per group with a zero point, fp8 e4m3; quantize, dequantize, and
  the round-trip error each format allows.
* :mod:`.linear`: ``nn.Linear`` stand-ins that keep the codes and call the kernel for them.
* :mod:`.swap`: which layers are quantized, and the swap itself (``LLM(model, quantization="int8")``).
"""

from minserve.quant.formats import QuantizationError, QuantizedWeight, quantize
from minserve.quant.linear import Fp8Linear, Int4Linear, Int8Linear, QuantizedLinear
from minserve.quant.swap import QuantScheme, quantize_model, weight_bytes

__all__ = [
    "Fp8Linear",
    "Int4Linear",
    "Int8Linear",
    "QuantScheme",
    "QuantizationError",
    "QuantizedLinear",
    "QuantizedWeight",
    "quantize",
    "quantize_model",
    "weight_bytes",
]
