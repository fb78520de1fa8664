"""`import hf_hooks` for the scripts in this folder: the module mla_diff_hooks.hf_hooks.

Why this exists: scripts here `import hf_hooks` with scripts/ on sys.path; the code lives in
python/mla_diff_hooks/hf_hooks.py (installed by `pip install mla-diff`). This file puts the
checkout's python/ first on sys.path and IS that module (sys.modules alias).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
from mla_diff_hooks import hf_hooks as _mod  # noqa: E402

sys.modules[__name__] = _mod
