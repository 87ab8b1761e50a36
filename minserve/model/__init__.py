"""The Llama-family model, its checkpoint loader and its tokenizer."""

from minserve.model.config import ModelConfig
from minserve.model.llama import LlamaForCausalLM
from minserve.model.loader import CheckpointError, ModelNotFoundError, load_model, resolve_model_path
from minserve.model.tokenizer import Tokenizer

__all__ = ["CheckpointError", "LlamaForCausalLM", "ModelConfig", "ModelNotFoundError", "Tokenizer", "load_model",
           "resolve_model_path"]  # fmt: skip
