"""Sphinx configuration of the hvd_rl docs (docs/README.md says why Sphinx).

The source directory is the repository root, not docs/, so that pages link to the committed
results, the SLURM guide and the README as documents, and the strict build (-W) checks every such
link. Only the files listed in include_patterns are read.

    make docs          # sphinx-build -W -c docs . docs/_build/html
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

from hvd_rl import __version__  # noqa: E402

project = "hvd_rl"
author = "the hvd_rl developers"
copyright = "2026, the hvd_rl developers"
release = version = __version__

extensions = ["myst_parser", "hvd_rl_reference"]
root_doc = "docs/index"
include_patterns = [
    "docs/**",
    "slurm/README.md",
    "benchmarks/LEARNING.md",
    "benchmarks/results/*.md",
    "benchmarks/results/**/*.md",
]
exclude_patterns = ["docs/_build/**", "docs/_ext/**", "**/.pytest_cache/**", "docs/README.md"]
source_suffix = {".md": "markdown"}

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3  # links to a page's sections (#heading) resolve and are checked
suppress_warnings = []

smartquotes = False  # values in the docs are copied into configs and shells as they are
html_theme = "furo"
html_title = f"hvd_rl {release}"
html_static_path = []
html_show_sourcelink = False
