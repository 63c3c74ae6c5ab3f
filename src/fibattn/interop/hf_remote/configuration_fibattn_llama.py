"""Configuration of a Fibonacci-sparse Llama written by ``fibattn export --format hf``.

transformers' ``LlamaConfig`` under a model type of its own, so transformers never loads the folder as
a dense Llama, plus ``fibattn``: the sparse settings (window, per-layer alphas, base, reach_len).
"""
from transformers import LlamaConfig


class FibattnLlamaConfig(LlamaConfig):
    model_type = "fibattn_llama"
