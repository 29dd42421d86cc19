"""Sphinx configuration of the course site (built by ``bash scripts/site.sh``).

``scripts/site.py`` writes the generated pages first (``chapters/``: the chapters as executed
once per commit by ``scripts/chapter_cache.py``; ``labs/``: the released labs, not executed);
Sphinx only reads them: myst-nb executes nothing.
"""

from __future__ import annotations

import minickpt

project = "Checkpointing in JAX"
author = "The minickpt course team"
copyright = "the minickpt course team"
release = version = minickpt.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx-mathjax-offline",  # MathJax 3 served with the site: it renders with no network
]
# No sphinx.ext.viewcode: minickpt's source holds the reference solutions of the labs.

exclude_patterns = ["_build", "README.md", "**/.ipynb_checkpoints"]

html_static_path = ["_static"]
html_css_files = ["course.css"]

# --- notebooks: read, never executed here ------------------------------------------------
nb_execution_mode = "off"
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist", "html_image"]
myst_heading_anchors = 3
suppress_warnings = ["mystnb.unknown_mime_type"]

# --- the API reference --------------------------------------------------------------------
autosummary_generate = False  # scripts/site.py writes one page per public module
autosummary_imported_members = False
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = False
napoleon_numpy_docstring = False

# --- the theme ----------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = "Checkpointing in JAX"
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": True,
    "use_fullscreen_button": False,
    "home_page_in_toc": True,
}
html_last_updated_fmt = ""
html_favicon = "_static/favicon.svg"
