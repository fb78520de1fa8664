"""The dump contract of docs/dump-format.md: site names, format strings, the format 1 and format 2
writers and the model identity a format-2 header carries.

Why this exists: every hook (`hf`, `llama_cpp`, `vllm`), the vLLM CPU harness (`vllm_cpu`) and the
kernel runner (`kernels`) write files that `mla-diff compare` reads, so what they must agree on
with mla-diff's reader is defined here once. `STAGES` is mla-diff's own stage list
(src/core/trace.rs, `STAGES`) in its data-flow order; python/tests/test_dump_format.py checks it,
the name templates and the format strings against `mla-diff sites --json`. Importing needs only
the standard library: the writers need numpy (through st_io), a GGUF's model identity gguf-py
(an HF checkpoint folder's nothing more).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from . import st_io  # the byte-reproducible safetensors writer

FORMAT1 = "mla-diff dump 1"
"""`__metadata__.format` of a format-1 dump: one step, `L{n}.{stage}` tensors, flat metadata."""
FORMAT2 = "mla-diff dump 2"
"""`__metadata__.format` of a format-2 dump: steps `s{k}.*`, a JSON `header`, `weights.*`."""
DUMP_FORMATS = (FORMAT1, FORMAT2)

KERNEL_INPUTS = "mla-diff kernel inputs 1"
"""`format` of what `mla-diff run --export-inputs` writes (read by the kernel runner)."""
VLLM_WEIGHTS = "mla-diff vllm weights 1"
"""`format` of the vLLM hook's WEIGHTS file (vLLM's parameter names, `[out, in]` float32)."""

STAGES = (
    "hidden_in",
    "attn_in",
    "w.fused_qkv_a",
    "q_c",
    "q_c_normed",
    "q",
    "kv_a",
    "kv_c_normed",
    "k_pe",
    "q_pe_roped",
    "k_pe_roped",
    "idx_q",
    "idx_k",
    "idx_weights",
    "idx_scores",
    "idx_topk",
    "w.kv_b",
    "k_nope",
    "v",
    "w.W_UK_T",
    "w.W_UV",
    "ql_nope",
    "attn_latent",
    "lse",
    "ctx_out",
    "ctx_lse",
    "suffix_out",
    "suffix_lse",
    "attn_out",
    "o_proj",
    "ffn_in",
    "ffn_gate",
    "ffn_up",
    "ffn_act",
    "ffn_out",
    "moe_router_logits",
    "moe_topk",
    "moe_out",
    "shared_out",
    "hidden_out",
)
"""Every stage of one MLA layer, in data-flow order (the order "first divergence" follows)."""

INDEXER_STAGES = ("idx_q", "idx_k", "idx_weights", "idx_scores", "idx_topk")
"""Stages of a DSA layer's lightning indexer (DeepSeek-V3.2, GLM-MoE-DSA)."""
MOE_STAGES = ("moe_router_logits", "moe_topk", "moe_out", "shared_out")
"""Stages only MoE layers have."""
FFN_STAGES = ("ffn_in", "ffn_gate", "ffn_up", "ffn_act", "ffn_out")
"""Stages of the layer's SwiGLU MLP: the dense FFN, or the shared experts of an MoE layer (whose
output is `shared_out`, not `ffn_out`)."""
ABSORBED_STAGES = ("ql_nope", "attn_latent")

CONTEXT_STAGES = ("ctx_out", "ctx_lse", "suffix_out", "suffix_lse")
"""The MHA prefill over cached context, `[Tc, N, V]` and `[Tc, N]` on the rows of the prefill
sequences with cached context: the context chunks merged and the new tokens' own causal
attention, which merge into `attn_out`; each chunk's own partial is `ctx_out.c{c}` /
`ctx_lse.c{c}` (SITE_TEMPLATES)."""
"""Stages only the absorbed (MQA) attention path computes; the expanded (MHA) path has none."""
WEIGHT_STAGES = tuple(s for s in STAGES if s.startswith("w."))
"""The weight sites (`w.*`)."""

RANKED_WEIGHTS = ("q_b", "kv_b", "o_proj", "gate_up", "down")
"""Weights tensor parallelism splits across ranks; a rank's shard is `L{n}.w.{weight}.rank{r}`
(`gate_up`: rows `[ffn_gate rows r·I/tp.. ; ffn_up rows r·I/tp..]`, [2·I/tp, H]; `down`: columns
`r·I/tp..(r+1)·I/tp` of `ffn_down`, [H, I/tp])."""

SITE_TEMPLATES = {
    "layer": "L{layer}.{stage}",
    "weight_rank": "L{layer}.w.{weight}.rank{rank}",
    "o_proj_rank": "L{layer}.o_proj.rank{rank}",
    "ffn_gate_up_rank": "L{layer}.ffn_gate_up.rank{rank}",
    "ffn_down_rank": "L{layer}.ffn_down.rank{rank}",
    "ctx_out_chunk": "L{layer}.ctx_out.c{chunk}",
    "ctx_lse_chunk": "L{layer}.ctx_lse.c{chunk}",
}
"""How a site is named: a layer's stage, a rank's weight shard, a rank's `o_proj` partial (before
the all-reduce), a rank's merged-column `gate_up_proj` output ([T, 2·I/tp], `[gate cols r·I/tp.. |
up cols r·I/tp..]`), a rank's row-parallel `down_proj` partial (before the all-reduce), and a
prefill's context chunk `c`: its attention output and LSE over that chunk's keys only."""

# Per-rank sites (`<base>.rank<r>`) sort just before the stage that consumes the shard or reduces
# the partials, as mla-diff orders them (src/core/trace.rs, `Stage::order`): (stage, offset).
_RANK_SITE_ORDER = {
    "w.q_b": ("q", -1),
    "w.kv_b": ("w.kv_b", 1),
    "w.o_proj": ("o_proj", -2),
    "o_proj": ("o_proj", -1),
    "w.gate_up": ("ffn_gate", -2),
    "ffn_gate_up": ("ffn_gate", -1),
    "w.down": ("ffn_out", -2),
    "ffn_down": ("ffn_out", -1),
}


def site(layer: int, stage: str) -> str:
    """`L{layer}.{stage}`, e.g. `site(3, "kv_c_normed") == "L3.kv_c_normed"`."""
    return SITE_TEMPLATES["layer"].format(layer=layer, stage=stage)


def weight_rank_site(layer: int, weight: str, rank: int) -> str:
    """`L{layer}.w.{weight}.rank{rank}`: TP rank `rank`'s shard of a RANKED_WEIGHTS weight."""
    if weight not in RANKED_WEIGHTS:
        raise ValueError(f"{weight!r} is not a ranked weight ({', '.join(RANKED_WEIGHTS)})")
    return SITE_TEMPLATES["weight_rank"].format(layer=layer, weight=weight, rank=rank)


def o_proj_rank_site(layer: int, rank: int) -> str:
    """`L{layer}.o_proj.rank{rank}`: TP rank `rank`'s `o_proj` partial sum, before the all-reduce."""
    return SITE_TEMPLATES["o_proj_rank"].format(layer=layer, rank=rank)


def ffn_gate_up_rank_site(layer: int, rank: int) -> str:
    """`L{layer}.ffn_gate_up.rank{rank}`: TP rank `rank`'s merged-column `gate_up_proj` output."""
    return SITE_TEMPLATES["ffn_gate_up_rank"].format(layer=layer, rank=rank)


def ffn_down_rank_site(layer: int, rank: int) -> str:
    """`L{layer}.ffn_down.rank{rank}`: TP rank `rank`'s `down_proj` partial, before the all-reduce."""
    return SITE_TEMPLATES["ffn_down_rank"].format(layer=layer, rank=rank)


def split_rank(stage: str) -> tuple[str, int] | None:
    """`"o_proj.rank1"` -> `("o_proj", 1)`, `"w.gate_up.rank0"` -> `("w.gate_up", 0)`; None for a
    stage without a `.rank{r}` suffix."""
    base, sep, rank = stage.rpartition(".rank")
    if sep and base and rank.isdigit():
        return base, int(rank)
    return None


def parse_site(name: str) -> tuple[int, str] | None:
    """`"L3.kv_c_normed"` -> `(3, "kv_c_normed")`; None for a name that is not `L{n}.{rest}`."""
    if name.startswith("L") and "." in name:
        layer, stage = name[1:].split(".", 1)
        if layer.isdigit():
            return int(layer), stage
    return None


def step_tensor(step: int, name: str) -> str:
    """A format-2 tensor name: `s{step}.{name}` (`name` a site, `tokens` or `positions`)."""
    return f"s{step}.{name}"


def weights_tensor(name: str) -> str:
    """A format-2 loaded-weight name: `weights.{name}` (`name` e.g. `L0.kv_b_proj`)."""
    return f"weights.{name}"


def site_order(order: Sequence[str]) -> Callable[[str], tuple]:
    """A sort key for tensor names: sites by layer, then by their stage's position in `order`
    (stages not in it after those, by name), then every other name (`tokens`, ...) by name. A
    per-rank site (`o_proj.rank1`, `w.gate_up.rank0`, ...) sorts just before the stage that
    consumes or reduces it (mla-diff's order), ranks in order."""
    index = {stage: 4 * i for i, stage in enumerate(order)}
    last = 4 * len(order)

    def key(name: str) -> tuple:
        parsed = parse_site(name)
        if parsed is None:
            return (1, 0, 0, name)
        layer, stage = parsed
        ranked = split_rank(stage)
        if ranked is not None and ranked[0] in _RANK_SITE_ORDER:
            target, offset = _RANK_SITE_ORDER[ranked[0]]
            if target in index:
                return (0, layer, index[target] + offset, f"{ranked[0]}.rank{ranked[1]:09d}")
        return (0, layer, index.get(stage, last), stage)

    return key


# --------------------------------------------------------------------------------------------
# writers
# --------------------------------------------------------------------------------------------


def write_format1(path, tensors: Mapping[str, Any], metadata: Mapping[str, Any]) -> Path:
    """Write a format-1 dump: `tensors` (numpy arrays, in the order given) and `metadata` (values
    stored as strings), its `format` set to FORMAT1. Returns the path."""
    path = Path(path)
    st_io.save(dict(tensors), path, metadata={**metadata, "format": FORMAT1})
    return path


def header_json(header: Mapping[str, Any], *, compact: bool = True) -> str:
    """The `header` metadata string of a format-2 dump. `compact` drops the spaces after `,` and
    `:`; the kernel runner writes json.dumps's default spacing, as its committed dumps have."""
    return json.dumps(header, separators=(",", ":") if compact else None)


def format2_metadata(
    header: Mapping[str, Any],
    *,
    notes: Iterable[str] = (),
    extra: Mapping[str, str] | None = None,
    compact: bool = True,
) -> dict[str, str]:
    """A format-2 dump's `__metadata__`: `format`, `header` (header_json), `notes` joined by
    " | " when there are any, then the informational `extra` keys."""
    meta = {"format": FORMAT2, "header": header_json(header, compact=compact)}
    notes = list(notes)
    if notes:
        meta["notes"] = " | ".join(notes)
    meta.update(extra or {})
    return meta


def write_format2(
    path,
    tensors: Mapping[str, Any],
    header: Mapping[str, Any],
    *,
    notes: Iterable[str] = (),
    extra: Mapping[str, str] | None = None,
    compact: bool = True,
    bf16_steps: bool = False,
) -> Path:
    """Write a format-2 dump: `tensors` (`s{k}.*`, `weights.*`; numpy arrays, in the order
    given) and the metadata of format2_metadata. Returns the path. With `bf16_steps`, a step's
    float32 site whose values are all bf16 values (a bf16 engine's activations) is stored as
    BF16: exact, half the bytes (st_io.bf16_bits); loaded weights stay as given."""
    path = Path(path)
    st_io.save(
        dict(tensors),
        path,
        metadata=format2_metadata(header, notes=notes, extra=extra, compact=compact),
        bf16_exact=(lambda name: name.startswith("s") and ".L" in name) if bf16_steps else None,
    )
    return path


# --------------------------------------------------------------------------------------------
# model identity
# --------------------------------------------------------------------------------------------


def model_identity(model_path, layers: Iterable[int]) -> dict:
    """`header.model` of a format-2 dump: the GGUF's file name, its size in bytes, the sha256 of
    the bytes before the tensor data (magic, version, metadata, tensor index, padding) and, per
    layer n in `layers`, the sha256 of its raw tensor bytes (every `blk.{n}.*` tensor, in
    tensor-index order). mla-diff compares them with the GGUF it is given. Needs gguf-py. A
    folder is a Hugging Face checkpoint: hf_model_identity."""
    path = Path(model_path)
    if path.is_dir():
        return hf_model_identity(path, layers)
    import gguf

    rd = gguf.GGUFReader(str(path))
    data = rd.data
    ident = {
        "file": path.name,
        "bytes": int(path.stat().st_size),
        "index_sha256": hashlib.sha256(data[: rd.data_offset].tobytes()).hexdigest(),
        "layer_sha256": {},
    }
    for n in layers:
        h = hashlib.sha256()
        for t in rd.tensors:
            if t.name.startswith(f"blk.{n}."):
                h.update(data[t.data_offset : t.data_offset + t.n_bytes].tobytes())
        ident["layer_sha256"][str(n)] = h.hexdigest()
    return ident


HF_FORMAT = "hf-safetensors"
"""`header.model.format` of a dump made from a Hugging Face checkpoint folder (absent: a GGUF)."""
HF_CONFIG, HF_INDEX, HF_SINGLE = "config.json", "model.safetensors.index.json", "model.safetensors"


def _safetensors_header(path: Path) -> tuple[bytes, dict, int]:
    """(the file's first 8 + n bytes, its parsed JSON header, the offset of its data section).
    Errors: ValueError naming the file for a header that is cut short or not a JSON object."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: shorter than a safetensors header length (8 bytes)")
        n = int.from_bytes(head, "little")
        if n > path.stat().st_size - 8:
            raise ValueError(f"{path}: header length {n} runs past the end of the file")
        body = f.read(n)
    meta = json.loads(body)
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: the safetensors header is not a JSON object")
    return head + body, meta, 8 + n


def hf_model_identity(folder, layers: Iterable[int]) -> dict:
    """`header.model` for a Hugging Face checkpoint folder (config.json and safetensors shards,
    docs/dump-format.md "Format 2", `model.format` = `hf-safetensors`):

    - `file`: the folder's name;
    - `format`: `hf-safetensors`;
    - `bytes`: the sum of the sizes of config.json, the index and each distinct shard the index
      names (a folder without an index: config.json and model.safetensors);
    - `index_sha256`: sha256 of config.json's bytes followed by the index file's bytes (without
      an index: followed by model.safetensors's first 8 + n bytes, its header);
    - `layer_sha256[n]`: sha256 of the raw data bytes (the safetensors `data_offsets` slice) of
      every tensor whose name starts with `model.layers.{n}.`, in ascending order of the names'
      UTF-8 bytes, concatenated (weights and their `weight_scale_inv` alike).

    Needs only the standard library. Errors: FileNotFoundError for a folder without config.json
    or any safetensors; ValueError naming the file for a malformed index or shard header."""
    folder = Path(folder)
    config = folder / HF_CONFIG
    if not config.is_file():
        raise FileNotFoundError(f"{folder}: no {HF_CONFIG} (not a Hugging Face checkpoint folder)")
    index = folder / HF_INDEX
    digest = hashlib.sha256(config.read_bytes())
    total = config.stat().st_size
    if index.is_file():
        raw = index.read_bytes()
        digest.update(raw)
        total += len(raw)
        weight_map = json.loads(raw).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: `weight_map` is not an object of tensor name -> shard file")
    elif (folder / HF_SINGLE).is_file():
        head, meta, _ = _safetensors_header(folder / HF_SINGLE)
        digest.update(head)
        weight_map = {k: HF_SINGLE for k in meta if k != "__metadata__"}
    else:
        raise FileNotFoundError(f"{folder}: neither {HF_INDEX} nor {HF_SINGLE}")
    headers: dict[str, tuple[dict, int]] = {}
    for shard in sorted(set(weight_map.values())):
        p = folder / shard
        if Path(shard).name != shard or not p.is_file():
            raise ValueError(f"{index}: shard {shard!r} is not a file of {folder}")
        _, meta, start = _safetensors_header(p)
        headers[shard] = (meta, start)
        total += p.stat().st_size
    ident = {
        "file": folder.name,
        "format": HF_FORMAT,
        "bytes": int(total),
        "index_sha256": digest.hexdigest(),
        "layer_sha256": {},
    }
    for n in layers:
        h = hashlib.sha256()
        prefix = f"model.layers.{int(n)}."
        names = sorted((k for k in weight_map if k.startswith(prefix)), key=lambda k: k.encode())
        for name in names:
            meta, start = headers[weight_map[name]]
            entry = meta.get(name)
            if not isinstance(entry, dict) or len(entry.get("data_offsets", ())) != 2:
                raise ValueError(f"{folder / weight_map[name]}: no tensor {name} (named by the index)")
            a, b = (int(x) for x in entry["data_offsets"])
            with open(folder / weight_map[name], "rb") as f:
                f.seek(start + a)
                h.update(f.read(b - a))
        ident["layer_sha256"][str(n)] = h.hexdigest()
    return ident
