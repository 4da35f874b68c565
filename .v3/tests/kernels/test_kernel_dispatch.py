"""kernels/__init__.py: the reference on CPU tensors, Triton when forced; the dispatchers in kernels.ops keep
working after the Triton submodules (named like them) are imported."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import torch, kernels
from kernels import reference
q = torch.randn(3, 4, 32); kc = torch.randn(8, 16, 2, 32); vc = torch.randn(8, 16, 2, 32)
tables = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32); lens = torch.tensor([5, 17, 30], dtype=torch.int32)
out, ref = torch.full_like(q, float('nan')), torch.full_like(q, float('nan'))
IMPORT_TRITON_MODULES
kernels.ops.paged_attention(out, q, kc, vc, tables, lens, 0.2)
reference.paged_attention(ref, q, kc, vc, tables, lens, 0.2)
assert callable(kernels.ops.paged_attention) and callable(kernels.ops.prefill_attention)
print(float((out - ref).norm() / ref.norm()), 'triton' in sys.modules)
"""


def run(choice: str, import_triton_modules: bool = False) -> tuple[float, bool]:
    # importing the Triton submodules first rebinds kernels.paged_attention etc.: kernels.ops must not care
    imports = (
        "import kernels.paged_attention, kernels.prefill_attention" if import_triton_modules else ""
    )
    script = "import sys\n" + SCRIPT.replace("IMPORT_TRITON_MODULES", imports)
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={
            "PAGEDCHAT_KERNELS": choice,
            "OMP_NUM_THREADS": "1",
            "PATH": "",
            **({"TRITON_INTERPRET": "1"} if import_triton_modules else {}),
        },
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    error, triton_loaded = result.stdout.split()
    return float(error), triton_loaded == "True"


def test_auto_on_cpu_uses_the_reference_without_importing_triton():
    assert run("auto") == (0.0, False)


def test_forced_triton_runs_the_interpreter_and_matches_the_reference():
    error, triton_loaded = run("triton", import_triton_modules=True)
    assert triton_loaded and error < 1e-5
