"""Side-by-side decode benchmark: pagedattn against its peers, on the same random caches.

Run it with ``pagedattn bench`` (or ``python -m pagedattn.bench``); ``README.md`` here says how,
and how to bring FlashInfer onto an offline GPU machine. Modules:

- ``cases``: one decode-step shape per :class:`~cases.Case`, named presets, KV-byte accounting;
- ``providers``: every implementation under test, registered in one dict;
- ``timing``: CUDA-graph replay over rotated KV copies, with a ``do_bench`` fallback;
- ``ceiling``: read and copy bandwidth measured in the same run;
- ``report``: CSV, markdown and plots;
- ``run``: the sweep.
"""
