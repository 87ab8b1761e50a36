"""Triton kernels, imported as ``minserve.kernels`` (a bare ``kernels`` would collide with a PyPI package).

Each file holds one kernel, its launcher, the torch reference it replaces and a ``benchmark()`` entry, side by
side: ``rms_norm`` (fused with the residual add), ``rotary``, ``silu_and_mul``, ``kv_store``,
``prefill_attention``, ``decode_attention`` (paged, split-K) and ``quant_matmul`` (int8 and int4 weights
widened inside the matmul, W8A16 and W4A16). They run on CUDA, and on the CPU under ``TRITON_INTERPRET=1``.
:mod:`minserve.model.backends` puts them behind the model, and :mod:`minserve.quant.linear` the quantized
matmuls behind its layers.
"""
