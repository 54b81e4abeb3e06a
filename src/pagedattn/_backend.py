"""Where the kernels run: on a machine without a CUDA GPU, Triton's CPU interpreter.

Triton reads ``TRITON_INTERPRET`` when a kernel is defined, so the choice is made here, before
pagedattn imports Triton: with no GPU and the variable unset, it is set to 1 (for the whole
process). If Triton was imported first, nothing can be changed here; the entry points then
say how to run on the CPU (``checks.check_device``).
"""

import os
import sys


def _select_interpreter() -> None:
    if "TRITON_INTERPRET" in os.environ or "triton" in sys.modules:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


_select_interpreter()
