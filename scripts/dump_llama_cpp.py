#!/usr/bin/env python3
"""The llama.cpp hook's command line in a checkout: runs `python -m mla_diff_hooks.llama_cpp`.

Why this exists: scripts and docs call `scripts/dump_llama_cpp.py`, and other scripts here `import dump_llama_cpp`;
the code lives in python/mla_diff_hooks/llama_cpp.py (installed by `pip install mla-diff`). This file
puts the checkout's python/ first on sys.path and, when imported, IS that module
(sys.modules alias), so attributes read or patched through `dump_llama_cpp` are the package's.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
from mla_diff_hooks import llama_cpp as _hook  # noqa: E402

if __name__ == "__main__":
    sys.exit(_hook.main())
sys.modules[__name__] = _hook
