"""Test-wide set-up. Triton's interpreter runs the kernels on the CPU when there is no GPU; it is chosen by
an environment variable read when triton is first imported, so it is set here, before any test imports it."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
