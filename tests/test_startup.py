"""fibattn starts without the compiler: importing it, or its command line, loads neither ``torch._dynamo`` nor
``torch._inductor`` (2.5 s of a 3.3 s start, most of which never compiles); what it stands in for them stays
what torch does."""
import subprocess
import sys

import torch

from fibattn.ops import backends


def test_importing_fibattn_and_its_cli_leaves_the_compiler_unloaded():
    code = ("import sys, fibattn, fibattn.cli; fibattn.cli.build_parser(); "
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor', 'fibattn.ops.triton_ops', 'triton') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr


def test_constant_result_marks_a_function_as_torch_compiler_does():
    def ours():
        return 1

    def torchs():
        return 1
    assert backends.constant_result(ours) is ours
    assert torch.compiler.assume_constant_result(torchs) is torchs
    assert vars(ours) == vars(torchs) == {"_dynamo_marked_constant": True}


def test_only_a_compiled_cuda_call_with_real_kernels_takes_the_traced_ops():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert not backends.compiled_triton("triton", cuda)           # eager: the direct path (eager.py)
    assert not backends.compiled_triton("triton", cpu)
    assert not backends.compiled_triton("cpu", cpu)
