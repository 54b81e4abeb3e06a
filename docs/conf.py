"""Sphinx configuration of the pagedattn docs: ``sphinx-build -W -b html docs docs/_build/html``.

Sphinx rather than MkDocs: the docstrings are numpydoc with reST roles (``:func:``, ``:data:``,
double backticks), which autodoc + napoleon render as written; the hand-written pages stay
Markdown through MyST.
"""

project = "pagedattn"
author = "pagedattn maintainers"
copyright = "pagedattn maintainers"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "myst_parser",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# numpydoc sections ("Parameters\n----------"), read by napoleon (bundled with Sphinx).
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False
# "a, b : int" stays one entry instead of one copy of its text per name.
napoleon_use_param = False
autodoc_member_order = "bysource"

# Markdown pages: "page.md#a-heading" links resolve to the heading's anchor.
myst_heading_anchors = 3

html_theme = "alabaster"
html_title = "pagedattn"
