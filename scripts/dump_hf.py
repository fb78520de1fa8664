#!/usr/bin/env python3
"""The HF transformers hook's command line in a checkout: runs `python -m mla_diff_hooks.hf`.

Why this exists: scripts and docs call `scripts/dump_hf.py`, and other scripts here `import dump_hf`;
the code lives in python/mla_diff_hooks/hf.py (installed by `pip install mla-diff`). This file
puts the checkout's python/ first on sys.path and, when imported, IS that module
(sys.modules alias), so attributes read or patched through `dump_hf` are the package's.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
from mla_diff_hooks import hf as _hook  # noqa: E402

if __name__ == "__main__":
    sys.exit(_hook.main())
sys.modules[__name__] = _hook
