"""`import st_io` for the scripts in this folder: the module mla_diff_hooks.st_io.

Why this exists: scripts here `import st_io` with scripts/ on sys.path; the code lives in
python/mla_diff_hooks/st_io.py (installed by `pip install mla-diff`). This file puts the
checkout's python/ first on sys.path and IS that module (sys.modules alias).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
from mla_diff_hooks import st_io as _mod  # noqa: E402

sys.modules[__name__] = _mod
