"""Sphinx configuration of posttrain's documentation.

Why Sphinx + MyST: it is what JAX, Flax and Optax (and MaxText's post-training guides) use, so a JAX user meets
the look and the cross-references they know; pages are Markdown (MyST) while the Python API comes from the
docstrings (autodoc), and a small extension (`_ext/posttrain_reference.py`) writes the CLI and config-key
reference from the code itself. Build: `pip install -e ".[docs]"`, then
`sphinx-build -W --keep-going -b html docs docs/_build/html` (warnings are errors; `.ci/run` builds it so).
"""

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(DOCS.parent))  # the checkout's posttrain, also without an editable install

project = "posttrain"
author = "posttrain developers"
copyright = "2026, posttrain developers"

extensions = ["myst_parser", "sphinx.ext.autodoc", "posttrain_reference"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", ".gitignore"]
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
default_role = "literal"  # `x` in the API's docstrings is code, as in the Markdown pages

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True}

html_theme = "sphinx_book_theme"
html_title = "posttrain"
html_theme_options = {"show_toc_level": 2}
