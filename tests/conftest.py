"""Test-wide settings.

Without a CUDA device the ``triton`` backend's kernels run on CPU tensors through Triton's
interpreter; it must be switched on before any kernel is defined (fibattn defines them on
first use of the backend). ``-m gpu`` runs the same tests natively on CUDA.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
