"""Models (LLaMA family) and their loading: GGUF, Hugging Face directories, dummy weights."""

from kvpage.models.config import ModelConfig
from kvpage.models.dtype_choice import choose_dtype
from kvpage.models.llama import LlamaForCausalLM
from kvpage.models.loader import DEFAULT_MODEL, LoadedModel, load_model, parse_dtype
from kvpage.models.tokenizer import Tokenizer

__all__ = [
    "DEFAULT_MODEL",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "Tokenizer",
    "choose_dtype",
    "load_model",
    "parse_dtype",
]
