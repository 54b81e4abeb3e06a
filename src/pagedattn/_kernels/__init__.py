"""Private Triton kernels; use the public API in :mod:`pagedattn`."""
