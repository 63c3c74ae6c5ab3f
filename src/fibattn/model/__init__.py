"""The model (method.md §4): the attention layer, RoPE and the decoder LM."""
from .attention import FibAttention
from .lm import Block, FibLM, SwiGLU
from .rope import RotaryEmbedding

__all__ = ["Block", "FibAttention", "FibLM", "RotaryEmbedding", "SwiGLU"]
