#!/usr/bin/env python3
"""Dump llama.cpp's intermediate MLA tensors (through llama-cpp-python) for `mla-diff compare`.

Why this exists: llama.cpp runs DeepSeek MLA in its own graph and exposes intermediates only
through the scheduler's eval callback; this module hooks that callback with llama-cpp-python's
low-level API, copies the F32 nodes the rename map uses and writes them in format 1 under
llama.cpp's own node names, which `--map llama.cpp` renames to mla-diff's stages. Reference
(options, keys, the node names relied on, layouts): docs/engines.md, "llama.cpp".
"""

from __future__ import annotations

import argparse
import ctypes
import json
import re
import sys
from pathlib import Path

from . import dump_format
from ._deps import optional, run_cli

np = optional("numpy", "mla_diff_hooks.llama_cpp", "llama-cpp")

# src/model/maps/llama.cpp.json (a link to it in the source tree, a copy in the wheel)
DEFAULT_MAP = Path(__file__).resolve().parent / "llama.cpp.json"

ENGINE = "llama.cpp (llama-cpp-python 0.3.36)"
GGML_TYPE_F32 = 0
GGML_MAX_DIMS = 4
GGML_MAX_OP_PARAMS = 64
GGML_MAX_SRC = 10
GGML_MAX_NAME = 64

# Nodes whose ggml shape is {X, T, N} (head-major): stored as [T, N, X].
HEAD_MAJOR = {"kq", "kq_soft_max", "kqv", "kqv_mla", "q_nope_perm", "q_nope_absorbed"}


class GgmlTensor(ctypes.Structure):
    """`struct ggml_tensor` of the vendored ggml/include/ggml.h (0.3.36), field for field."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * GGML_MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * GGML_MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


assert ctypes.sizeof(GgmlTensor) == 336, ctypes.sizeof(GgmlTensor)

_LAYER_NAME = re.compile(r"^(.*)-(\d+)$")
_WEIGHT_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")
_UNNAMED = re.compile(r"^node_\d+$")


def node_name(t: GgmlTensor) -> str:
    """The node's name; an unnamed weight matmul is named "<weight>-<layer>" after its weight."""
    name = t.name.decode("utf-8", "replace")
    if _UNNAMED.match(name) and t.src[0]:
        w = GgmlTensor.from_address(t.src[0]).name.decode("utf-8", "replace")
        m = _WEIGHT_NAME.match(w)
        if m:
            return f"{m.group(2)}-{m.group(1)}"
    return name


def layer_of(name: str) -> int | None:
    """Layer number of a "<name>-<layer>" node name, None for layer-less names."""
    m = _LAYER_NAME.match(name)
    return int(m.group(2)) if m else None


def read_f32(t: GgmlTensor) -> np.ndarray:
    """Copy an F32 tensor in host memory, following its byte strides (views included)."""
    ne = [int(t.ne[i]) for i in range(GGML_MAX_DIMS)]
    nb = [int(t.nb[i]) for i in range(GGML_MAX_DIMS)]
    if min(ne) == 0:
        return np.zeros(tuple(reversed(ne)), np.float32)
    span = sum((n - 1) * s for n, s in zip(ne, nb)) + 4
    raw = np.frombuffer((ctypes.c_char * span).from_address(t.data), dtype=np.float32)
    a = np.lib.stride_tricks.as_strided(raw, shape=tuple(reversed(ne)), strides=tuple(reversed(nb))).copy()
    if ne[3] == 1:
        a = a[0]
        if ne[2] == 1:
            a = a[0]
    return a


class Recorder:
    """The eval callback's state: occurrence counts, the node being computed, what was copied."""

    def __init__(self, keep):
        self.keep = keep  # key -> bool
        self.counts: dict[str, int] = {}
        self.pending: str | None = None
        self.out: dict[str, np.ndarray] = {}
        self.permuted: set[str] = set()
        self.error: BaseException | None = None

    def __call__(self, t_ptr, ask, _user_data) -> bool:
        """ggml_backend_sched_eval_callback: ask=True selects a node, ask=False reads it."""
        try:
            t = GgmlTensor.from_address(t_ptr)
            if ask:
                name = node_name(t)
                k = self.counts.get(name, 0)
                self.counts[name] = k + 1
                key = f"{name}#{k}"
                want = t.type == GGML_TYPE_F32 and bool(t.data) and self.keep(key)
                self.pending = key if want else None
                return want
            if self.pending is not None:
                a = read_f32(t)
                base = _LAYER_NAME.sub(r"\1", self.pending.rsplit("#", 1)[0])
                if base in HEAD_MAJOR and a.ndim == 3:
                    a = np.ascontiguousarray(a.transpose(1, 0, 2))
                    self.permuted.add(base)
                self.out[self.pending] = a
                self.pending = None
            return True
        except BaseException as e:  # never let an exception unwind through C
            self.error = e
            return False


CONDITIONS = ("split_kv_b", "fused_kv_b", "q_lora", "no_q_lora", "dense_ffn", "moe_ffn")


def condition_holds(cond: str | None, q_lora: bool, fused_kv_b: bool, dense_ffn: bool | None = None) -> bool:
    """A map rule's optional condition (src/model/dump/map.rs `Condition`) for a model's facts;
    `dense_ffn`: whether the rule's layer runs a dense MLP rather than the MoE FFN (None: the rule
    has no layer, and neither layer condition, `dense_ffn` nor `moe_ffn`, holds)."""
    if cond is None:
        return True
    if cond not in CONDITIONS:
        raise ValueError(f"unknown map condition {cond!r} (expected one of {', '.join(CONDITIONS)})")
    return {
        "split_kv_b": not fused_kv_b,
        "fused_kv_b": fused_kv_b,
        "q_lora": q_lora,
        "no_q_lora": not q_lora,
        "dense_ffn": dense_ffn is True,
        "moe_ffn": dense_ffn is False,
    }[cond]


def map_keys(
    map_path: Path,
    layers: list[int],
    q_lora: bool = True,
    fused_kv_b: bool = False,
    n_dense_lead: int | None = None,
) -> set[str]:
    """Dump keys that the map renames, for the given layers ({n} expanded; "L<k>." literals kept
    when k is one of the layers), skipping rules whose condition does not hold for the model at
    that layer. n_dense_lead: layers below it run a dense MLP, the others the MoE FFN (None: every
    layer is dense)."""
    m = json.loads(Path(map_path).read_text())
    keys = set()

    def holds(cond, layer):
        dense = None if layer is None else (n_dense_lead is None or layer < n_dense_lead)
        return condition_holds(cond, q_lora, fused_kv_b, dense)

    for rule in m.get("rename", []):
        src, dst = rule[0], rule[1]
        cond = rule[2] if len(rule) > 2 else None
        if "{n}" in src:
            keys.update(src.replace("{n}", str(n)) for n in layers if holds(cond, n))
        else:
            lm = re.match(r"^L(\d+)\.", dst)
            layer = None if lm is None else int(lm.group(1))
            if (layer is None or layer in layers) and holds(cond, layer):
                keys.add(src)
    return keys


def gguf_facts(model_path: Path) -> tuple[int, int, bool, bool, bool, int]:
    """(n_vocab, n_layer, has q_lora (rank > 0), q_lora_rank key present, legacy fused kv_b
    (blk.0.attn_kv_b.weight present), dense-lead layers (below it a dense MLP, from it on the MoE
    FFN: leading_dense_block_count, or n_layer without expert_count)) from the GGUF header."""
    import gguf

    r = gguf.GGUFReader(str(model_path))
    arch = r.fields["general.architecture"].contents()
    n_vocab = len(r.fields["tokenizer.ggml.tokens"].data)
    n_layer = int(r.fields[f"{arch}.block_count"].contents())
    f = r.fields.get(f"{arch}.attention.q_lora_rank")
    fused_kv_b = any(t.name == "blk.0.attn_kv_b.weight" for t in r.tensors)
    e = r.fields.get(f"{arch}.expert_count")
    lead = r.fields.get(f"{arch}.leading_dense_block_count")
    n_dense_lead = n_layer if e is None or int(e.contents()) == 0 else int(lead.contents()) if lead else 0
    return n_vocab, n_layer, f is not None and int(f.contents()) > 0, f is not None, fused_kv_b, n_dense_lead


def run(
    model_path: Path,
    tokens: list[int],
    keep,
    n_threads: int = 1,
    verbose: bool = False,
    q_lora_zero: bool = False,
):
    """Decode `tokens` at positions 0..T-1 in one batch; return (Recorder, n_layer).

    q_lora_zero: load with the override deepseek2.attention.q_lora_rank = 0, for converter output
    without q compression, which has no such key; llama.cpp requires the key unless the layer count
    looks like a released "lite" model (golden/README.md, "lite-v2 and the missing q_lora_rank").
    """
    import llama_cpp.llama_cpp as L

    if not verbose:
        log_cb = L.llama_log_callback(lambda level, text, ud: None)
        L.llama_log_set(log_cb, ctypes.c_void_p())
        run._log_cb = log_cb  # keep the ctypes callback alive
    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    mparams.n_gpu_layers = 0
    if q_lora_zero:
        kvo = (L.llama_model_kv_override * 2)()  # second entry: the empty-key terminator
        kvo[0].key = b"deepseek2.attention.q_lora_rank"
        kvo[0].tag = L.LLAMA_KV_OVERRIDE_TYPE_INT
        kvo[0].value.val_i64 = 0
        mparams.kv_overrides = kvo
    model = L.llama_model_load_from_file(str(model_path).encode(), mparams)
    if not model:
        raise RuntimeError(f"{model_path}: llama.cpp could not load the model (run with --verbose)")
    rec = Recorder(keep)
    cb = L.ggml_backend_sched_eval_callback(rec)
    n = len(tokens)
    cparams = L.llama_context_default_params()
    cparams.n_ctx = max(64, n)
    cparams.n_batch = cparams.n_ubatch = max(64, n)
    cparams.n_seq_max = 1
    cparams.n_threads = cparams.n_threads_batch = n_threads
    cparams.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cparams.type_k = cparams.type_v = L.GGML_TYPE_F32
    cparams.offload_kqv = False
    cparams.cb_eval = cb
    cparams.cb_eval_user_data = None
    ctx = L.llama_init_from_model(model, cparams)
    if not ctx:
        L.llama_model_free(model)
        raise RuntimeError(f"{model_path}: llama_init_from_model failed")
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    n_layer = L.llama_model_n_layer(model)
    bad = [x for x in tokens if not 0 <= x < n_vocab]
    if bad:
        raise ValueError(f"token ids {bad} outside the vocabulary (n_vocab {n_vocab})")
    batch = L.llama_batch_init(n, 0, 1)
    try:
        batch.n_tokens = n
        for i, tok in enumerate(tokens):
            batch.token[i] = tok
            batch.pos[i] = i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1  # every token is an output: no row pruning in the last layer
        rc = L.llama_decode(ctx, batch)
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)
    if rec.error is not None:
        raise rec.error
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc}")
    return rec, n_layer


def parse_ints(s: str) -> list[int]:
    """ "5,17,3" -> [5, 17, 3]."""
    return [int(x) for x in s.split(",") if x.strip()]


def main(argv=None) -> int:
    """CLI entry point; docs/engines.md ("llama.cpp") describes the options."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--tokens", type=parse_ints)
    ap.add_argument("--n-tokens", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=parse_ints)
    ap.add_argument("--all", action="store_true", help="keep every F32 node, not only the mapped ones")
    ap.add_argument("--map", type=Path, default=DEFAULT_MAP)
    ap.add_argument(
        "--exclude",
        type=lambda x: [k for k in x.split(",") if k],
        default=[],
        help="comma-separated keys not to store (e.g. embd#0: tokens suffice)",
    )
    ap.add_argument(
        "--include",
        type=lambda x: [k for k in x.split(",") if k],
        default=[],
        help="comma-separated extra keys to store besides the mapped ones (e.g. kqv-0#0)",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--verbose", action="store_true", help="show llama.cpp's log")
    a = ap.parse_args(argv)

    if not a.model.is_file():
        ap.error(f"{a.model}: no such file")
    if not a.all and not a.map.is_file():
        ap.error(f"--map {a.map}: no such file (src/model/maps/llama.cpp.json in mla-diff's source)")
    n_vocab, n_layer, q_lora, has_q_lora_key, fused_kv_b, n_dense_lead = gguf_facts(a.model)
    if a.tokens is not None:
        tokens = a.tokens
    else:
        tokens = [int(x) for x in np.random.default_rng(a.seed).integers(0, n_vocab, a.n_tokens)]
    if not tokens:
        ap.error("no tokens")
    layers = a.layers if a.layers is not None else list(range(n_layer))
    if any(not 0 <= n < n_layer for n in layers):
        ap.error(f"--layers {layers}: the model has layers 0..{n_layer - 1}")

    if a.all:
        wanted = None

        def keep(key: str) -> bool:
            layer = layer_of(key.rsplit("#", 1)[0])
            return (layer is None or layer in layers) and key not in a.exclude
    else:
        wanted = map_keys(a.map, layers, q_lora=q_lora, fused_kv_b=fused_kv_b, n_dense_lead=n_dense_lead)
        wanted |= set(a.include)
        wanted -= set(a.exclude)

        def keep(key: str) -> bool:
            return key in wanted

    if not has_q_lora_key:
        print("note: no q_lora_rank key: loading with the override q_lora_rank = 0", file=sys.stderr)
    rec, _ = run(a.model, tokens, keep, a.threads, a.verbose, q_lora_zero=not has_q_lora_key)
    out = rec.out
    if wanted is not None and wanted - set(out):
        print(
            f"warning: mapped nodes not in the graph: {', '.join(sorted(wanted - set(out)))}", file=sys.stderr
        )

    tensors = {"tokens": np.array(tokens, np.int64), "positions": np.arange(len(tokens), dtype=np.int64)}
    tensors.update(out)
    meta = {
        "engine": ENGINE,
        "dtype": "f32",
        "model": a.model.name,
        "rope_order": "interleaved",
        "layout": "token-major",
        "kv_a_order": "latent-rope",
    }
    if rec.permuted:
        meta["permuted_to_token_major"] = ",".join(sorted(rec.permuted))
    dump_format.write_format1(a.out, tensors, meta)
    nbytes = a.out.stat().st_size
    print(f"wrote {a.out}: {len(out)} tensors, {len(tokens)} tokens, {nbytes} bytes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main, "python -m mla_diff_hooks.llama_cpp", "llama-cpp"))
