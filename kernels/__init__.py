"""Triton kernels, imported as ``minserve.kernels`` (a bare ``kernels`` would collide with a PyPI package).

Each kernel file holds the kernel, its launcher, a torch reference and a benchmark entry, side by side.
"""
