#!/usr/bin/env python3
"""Run llama.cpp's official HF -> GGUF converter with no model hub and no tokenizer files.

Why this exists: the fixtures must come out of the real converter (so mla-diff is tested on the
key names, tensor splits and layouts that real DeepSeek GGUFs have), but the converter insists on
loading a real tokenizer in its vocab step, and our random-initialised models have none. This
wrapper imports the converter as a module, swaps the ``set_vocab`` of the MLA classes (DeepSeek-V2/V3,
DeepSeek-V3.2, GLM-MoE-DSA, MiniCPM3) for one
that writes a tiny synthetic byte-level BPE vocab, and then calls the converter's own ``main()``
with the remaining command-line arguments. Nothing in the converter's tensor or metadata path is
touched, and no modified copy of the converter is stored anywhere.

It is run as a subprocess by make_fixtures.py, because the converter must use the gguf-py that
ships next to it (vendor/llama.cpp/gguf-py, which is newer than the PyPI wheel), and that copy must
not be mixed with the PyPI ``gguf`` used by the rest of the fixture pipeline.

Usage:
    python scripts/convert_offline.py --llama-cpp-dir DIR  HF_MODEL_DIR --outfile OUT.gguf --outtype f32
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# Synthetic vocab layout (vocab size must equal the model's vocab_size: 256, or 128 for the
# small MoE/DSA/MiniCPM3 fixtures):
#   0..2   control tokens  <s> </s> <unk>
#   3..254 single bytes 0x00..0xFB in GPT-2 byte-to-unicode spelling
#   255    one merged token (two spaces, "ĠĠ") so that the merge list is non-empty and valid
N_SPECIAL = 3
SPECIALS = ["<s>", "</s>", "<unk>"]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode map (the spelling llama.cpp expects)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def synthetic_vocab(vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """Return (tokens, token types, merges) for a small, self-consistent byte-level BPE vocab."""
    import gguf  # the converter's own gguf-py (already first on sys.path)

    b2u = _bytes_to_unicode()
    n_bytes = vocab_size - N_SPECIAL - 1
    if n_bytes < 0x21:  # must at least contain the space byte 0x20
        raise ValueError(f"vocab_size {vocab_size} too small for the synthetic vocab")
    tokens = list(SPECIALS) + [b2u[b] for b in range(n_bytes)]
    space = b2u[0x20]
    tokens.append(space + space)
    merges = [f"{space} {space}"]
    types = [gguf.TokenType.CONTROL] * N_SPECIAL + [gguf.TokenType.NORMAL] * (vocab_size - N_SPECIAL)
    assert len(tokens) == vocab_size and len(set(tokens)) == vocab_size
    return tokens, types, merges


def install_vocab_patch() -> None:
    """Replace set_vocab at run time on every converter class the fixtures use: DeepseekV2Model
    (shared by the V2 and V3 HF classes) and the classes that override it with their own
    tokenizer step: DeepseekV32Model (AutoTokenizer + GPT-2 BPE), GlmMoeDsaModel (GLM's
    tokenizer) and MiniCPM3Model (sentencepiece). All get the same synthetic GPT-2 vocab."""
    from conversion import deepseek, glm, minicpm  # the converter's package (vendor/llama.cpp/conversion)

    def set_vocab(self) -> None:
        vocab_size = int(self.hparams["vocab_size"])
        tokens, types, merges = synthetic_vocab(vocab_size)
        w = self.gguf_writer
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
        w.add_unk_token_id(2)
        w.add_add_bos_token(False)

    for cls in (deepseek.DeepseekV2Model, deepseek.DeepseekV32Model, glm.GlmMoeDsaModel,
                minicpm.MiniCPM3Model):
        cls.set_vocab = set_vocab


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, add_help=True
    )
    ap.add_argument("--llama-cpp-dir", type=Path, required=True,
                    help="the sdist's vendor/llama.cpp folder (holds convert_hf_to_gguf.py, gguf-py/)")
    ours, rest = ap.parse_known_args()

    conv_dir = ours.llama_cpp_dir.resolve()
    if not (conv_dir / "convert_hf_to_gguf.py").is_file():
        sys.exit(f"error: {conv_dir}/convert_hf_to_gguf.py not found")
    # No hub: make any accidental hub access fail fast instead of hanging.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    # The converter itself puts its gguf-py first on sys.path when imported; we add both folders
    # so that `conversion` and `gguf` resolve to the vendored copies.
    sys.path.insert(0, str(conv_dir / "gguf-py"))
    sys.path.insert(0, str(conv_dir))

    import convert_hf_to_gguf  # noqa: E402  (the official converter, unmodified)

    install_vocab_patch()
    sys.argv = [str(conv_dir / "convert_hf_to_gguf.py"), *rest]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
