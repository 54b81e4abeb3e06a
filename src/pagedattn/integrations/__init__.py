"""Entry points in the shapes serving engines use, over :func:`pagedattn.plan_decode` and
:func:`pagedattn.paged_decode`.

- :class:`BatchDecodeWrapper` (:mod:`pagedattn.integrations.flashinfer`): FlashInfer's
  decode-wrapper shape: ``plan()`` once per step from the CSR page form, ``run()`` per layer.
- :func:`vllm_paged_decode` (:mod:`pagedattn.integrations.vllm`): vLLM's paged-attention
  arguments.
- :mod:`pagedattn.integrations.transformers`: the decode attention of Hugging Face
  transformers' continuous batching (``register()`` returns the ``attn_implementation`` name);
  imported on its own, as it needs transformers.
"""

from .flashinfer import BatchDecodeWrapper
from .vllm import vllm_paged_decode

__all__ = ["BatchDecodeWrapper", "vllm_paged_decode"]
