"""Start-up cost: building a model must not pull in PyTorch's compiler stack.

Models are built on the meta device; any meta-tensor op implemented by a Python reference (``arange``,
``normal_``, ...) imports ``torch._dynamo`` (about half a second per process, paid by the target, every
tensor-parallel rank and the SSD draft worker). Checked in a fresh interpreter, since this test session may
have imported it already.
"""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
import torch
from ssd.models.loader import load_model
model, _ = load_model(sys.argv[1], dtype=torch.float32)
assert model.rotary.inv_freq.device.type == "cpu" and model.rotary.inv_freq.dtype == torch.float32
print("torch._dynamo" in sys.modules)
"""


def test_loading_a_model_does_not_import_the_compiler_stack(checkpoint_factory):
    path = checkpoint_factory("llama")
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
