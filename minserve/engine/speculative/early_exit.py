"""A self-speculative draft: the target's own first layers, then its final norm and head (early exit).

A model with no shipped draft (SmolLM2-135M-Instruct) can still draft for itself without training: run only
its first n of L layers and read the next token off the shared head. The draft costs about n/L of a target
step and needs no weights of its own: :func:`early_exit_view` shares every tensor with the target. What it
lacks is agreement: untrained for early exit, the first layers' hidden state is not what the head was
trained to read, so its acceptance rate α is low; LayerSkip (Elhoushi et al. 2024) trains for it.

The view is a second module tree over the same parameters, so it can hold a KV cache of its own (n layers
of it, in the draft proposer's runner) without touching the target's.
"""

from __future__ import annotations

import copy
from dataclasses import replace

from torch import nn

from minserve.model.llama import LlamaForCausalLM


def early_exit_view(model: LlamaForCausalLM, num_layers: int) -> LlamaForCausalLM:
    """``model``'s first ``num_layers`` decoder layers with its embedding, final norm and head; every tensor
    shared (no bytes copied), every module its own (so per-module state, the KV cache, is separate)."""
    total = model.config.num_layers
    if not 1 <= num_layers < total:
        raise ValueError(
            f"speculative_config: num_draft_layers must be between 1 and {total - 1} for this model "
            f"({total} layers), got {num_layers}"
        )
    view = _same_tensors_new_modules(model)
    view.layers = nn.ModuleList(view.layers[:num_layers])
    view.config = replace(model.config, num_layers=num_layers)
    return view


def _same_tensors_new_modules(module: nn.Module) -> nn.Module:
    """A copy of the module tree whose parameters and buffers are the original's own tensors."""
    clone = copy.copy(module)  # a new object with a shallow copy of the attributes
    clone._parameters = dict(module._parameters)
    clone._buffers = dict(module._buffers)
    clone._modules = {name: _same_tensors_new_modules(child) for name, child in module._modules.items()}
    return clone
