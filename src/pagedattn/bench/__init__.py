"""``pagedattn bench``: the side-by-side decode benchmark (pagedattn against its peers and the
read ceiling): cases, providers, CUDA-graph timing, the ceiling kernel, reports. ``cli`` holds
the command line; ``run`` the sweep. Needs a CUDA GPU, except ``--list-cases`` and ``--help``.
"""
