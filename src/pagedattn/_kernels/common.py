"""Helpers shared by the Triton kernels."""

import os

import triton
import triton.language as tl

# ln(2): LSEs are kept in log2 units inside the kernels and reported in natural log.
LN2 = tl.constexpr(0.6931471805599453)


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def dot_any(a, b, DOT_FP32: tl.constexpr, acc=None):
    # The interpreter multiplies raw bit patterns for bf16 dots, so it gets float32 operands;
    # compiled code keeps the operands' own dtype for the tensor cores.
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)
