"""mla_diff_hooks on a block-FP8 Hugging Face checkpoint without vLLM: the dequantized weights, the
engine's quantization record, the folder's model identity and the fp8-scale-transposed plant.

Why this exists: vLLM runs golden/hf-v3-fp8 only on a GPU, and the hooks' weights dump is what
`weights --check` judges there; a dequantization that is off, an identity the Rust side hashes
differently, or a plant that moves other scales than it says would each make the live dumps stand
for something else. The vLLM classes involved (Fp8LinearMethod, the block-scaled kernels, vLLM
0.26's get_and_maybe_dequant_weights) are stood in for by classes of the same names and
behaviour, read from vllm/model_executor/layers/quantization/fp8.py,
vllm/model_executor/kernels/linear/scaled_mm/ and .../quantization/utils/quant_utils.py.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import types

import numpy as np
import pytest

from support import GOLDEN, hooks_module

torch = pytest.importorskip("torch", reason="the vLLM stand-ins are torch modules")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="the fixture is read with safetensors")

dump_vllm = hooks_module("vllm")
dump_format = hooks_module("dump_format")
plants = hooks_module("plants")

FP8 = GOLDEN / "hf-v3-fp8"


# ---- vLLM 0.26 stand-ins -------------------------------------------------------------------


class Fp8BlockScaledMMLinearKernel:
    """BlockScaledMMLinearKernel.py: process_weights_after_loading replaces weight and
    weight_scale_inv by themselves on CUDA (no transpose, no padding)."""

    def process_weights_after_loading(self, layer):
        return None


class CutlassFp8BlockScaledMMKernel(Fp8BlockScaledMMLinearKernel):
    """cutlass.py: inherits the base's processing; apply passes B.T and Bs.T views."""


class DeepGemmFp8BlockScaledMMKernel(Fp8BlockScaledMMLinearKernel):
    """deep_gemm.py: re-lays out the scales for DeepGEMM (its own processing)."""

    def process_weights_after_loading(self, layer):
        return None


class Fp8LinearMethod:
    def __init__(self, kernel=None, deep_gemm=False):
        self.block_quant = True
        self.use_marlin = False
        self.use_deep_gemm = deep_gemm
        self.weight_block_size = [128, 128]
        self.fp8_linear = kernel or CutlassFp8BlockScaledMMKernel()

    def process_weights_after_loading(self, layer):
        self.fp8_linear.process_weights_after_loading(layer)


class Fp8MoeBackend:
    name = "TRITON"


class Fp8MoEMethod:
    fp8_backend = Fp8MoeBackend()


class Fp8Linear(torch.nn.Module):
    def __init__(self, codes: torch.Tensor, scale: torch.Tensor, prefix: str, method=None):
        super().__init__()
        self.weight = torch.nn.Parameter(codes.view(torch.float8_e4m3fn), requires_grad=False)
        self.weight_scale_inv = torch.nn.Parameter(scale.clone(), requires_grad=False)
        self.weight_block_size = [128, 128]
        self.input_size_per_partition = codes.shape[1]
        self.prefix = prefix
        self.quant_method = method or Fp8LinearMethod()


def vllm_get_and_maybe_dequant_weights(layer, out_dtype=torch.float32):
    """vLLM 0.26's block-FP8 branch of get_and_maybe_dequant_weights (quant_utils.py:404-450):
    scaled_dequantize asserts whole blocks, then broadcasts the scale over them in float32."""
    assert not layer.quant_method.use_marlin and not layer.quant_method.use_deep_gemm
    x_q, x_s, gs = layer.weight, layer.weight_scale_inv, layer.weight_block_size
    assert x_s.shape[-1] == x_q.shape[-1] // gs[1]
    assert x_s.shape[-2] == x_q.shape[-2] // gs[0]
    s = x_s.to(torch.float32).repeat_interleave(gs[0], 0).repeat_interleave(gs[1], 1)
    return (x_q.to(torch.float32) * s).to(out_dtype)


@pytest.fixture
def fake_vllm(monkeypatch):
    """A `vllm` package whose quant_utils is vllm_get_and_maybe_dequant_weights and whose fp8
    module holds Fp8LinearMethod."""
    names = [
        "vllm",
        "vllm.model_executor",
        "vllm.model_executor.layers",
        "vllm.model_executor.layers.quantization",
        "vllm.model_executor.layers.quantization.utils",
        "vllm.model_executor.layers.quantization.utils.quant_utils",
        "vllm.model_executor.layers.quantization.fp8",
    ]
    for n in names:
        monkeypatch.setitem(sys.modules, n, types.ModuleType(n))
    sys.modules[names[5]].get_and_maybe_dequant_weights = vllm_get_and_maybe_dequant_weights
    sys.modules[names[6]].Fp8LinearMethod = Fp8LinearMethod
    sys.modules[names[3]].fp8 = sys.modules[names[6]]
    monkeypatch.setattr(
        Fp8LinearMethod, "process_weights_after_loading", Fp8LinearMethod.process_weights_after_loading
    )


def vectors() -> dict[str, torch.Tensor]:
    return safetensors_torch.load_file(str(FP8 / "dequant_vectors.safetensors"))


def checkpoint(name: str) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(FP8.glob("model-*.safetensors")):
        for k, v in safetensors_torch.load_file(str(shard)).items():
            if k.startswith(name):
                out[k[len(name) :]] = v
    return out


# ---- dequantization -----------------------------------------------------------------------------


def test_block_dequant_scales_each_block_and_cuts_the_edge_blocks():
    w = np.arange(15, dtype=np.float32).reshape(3, 5) - 7  # [3, 5] in 2x2 blocks: grid [2, 3]
    s = np.array([[1, 2, 4], [8, 16, 32]], dtype=np.float32)
    out = dump_vllm.block_dequant(w, s, (2, 2))
    assert out.dtype == np.float32 and out.shape == (3, 5)
    assert out[0].tolist() == [-7, -6, -10, -8, -12]  # row 0: scales 1, 1, 2, 2, 4
    assert out[2].tolist() == [24, 32, 80, 96, 224]  # row 2 (edge row): 8, 8, 16, 16, 32
    with pytest.raises(
        ValueError, match=r"weight \[3, 5\] in 2x2 blocks has a \[2, 3\] scale grid, the scale is \[3, 2\]"
    ):
        dump_vllm.block_dequant(w, s.T.copy(), (2, 2))


def test_block_dequant_matches_the_reference_vectors_bit_for_bit():
    v = vectors()
    for name in ("q_a", "kv_a", "synthetic"):  # whole, edge-row, edge-column and corner blocks
        w = v[f"{name}.fp8"].view(torch.float8_e4m3fn).float().numpy()
        got = dump_vllm.block_dequant(w, v[f"{name}.scale_inv"].numpy(), (128, 128))
        want = v[f"{name}.dequant_f32"].numpy()
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), name


def test_fused_qkv_a_falls_back_where_vllm_asserts_and_kv_b_goes_through_vllm(fake_vllm):
    v = vectors()
    # vLLM's fused_qkv_a_proj: q_a rows then kv_a rows, scales stacked: [704, 256] and [6, 2]
    codes = torch.cat([v["q_a.fp8"], v["kv_a.fp8"]])
    scale = torch.cat([v["q_a.scale_inv"], v["kv_a.scale_inv"]])
    fused = Fp8Linear(codes, scale, "model.layers.0.self_attn.fused_qkv_a_proj")
    with pytest.raises(AssertionError):
        vllm_get_and_maybe_dequant_weights(fused)  # 704 // 128 = 5 row blocks, the grid has 6
    w, how = dump_vllm.dequant_weight(fused, torch.bfloat16)
    want = np.concatenate([v["q_a.dequant_f32"].numpy(), v["kv_a.dequant_f32"].numpy()])
    assert w.shape == (704, 256) and np.array_equal(w.view(np.uint32), want.view(np.uint32))
    assert how.startswith("Fp8LinearMethod (CutlassFp8BlockScaledMMKernel, block 128x128): weight x ")
    assert "; vLLM's get_and_maybe_dequant_weights refused it (AssertionError" in how
    ck = checkpoint("model.layers.0.self_attn.kv_b_proj.")
    kv_b = Fp8Linear(
        ck["weight"].view(torch.uint8), ck["weight_scale_inv"], "model.layers.0.self_attn.kv_b_proj"
    )
    w, how = dump_vllm.dequant_weight(kv_b, torch.bfloat16)
    assert how == (
        "Fp8LinearMethod via vllm get_and_maybe_dequant_weights "
        "(CutlassFp8BlockScaledMMKernel, block 128x128)"
    )
    own = dump_vllm.block_dequant(ck["weight"].float().numpy(), ck["weight_scale_inv"].numpy(), (128, 128))
    assert w.shape == (1024, 512) and np.array_equal(w, own)


def test_own_block_dequant_only_where_the_checkpoint_layout_is_kept():
    v = vectors()
    layer = Fp8Linear(v["kv_a.fp8"], v["kv_a.scale_inv"], "p")
    assert dump_vllm._fp8_block_layer(layer)[2:] == ((128, 128), "CutlassFp8BlockScaledMMKernel")
    for method in (Fp8LinearMethod(DeepGemmFp8BlockScaledMMKernel()), Fp8LinearMethod(deep_gemm=True)):
        assert dump_vllm._fp8_block_layer(Fp8Linear(v["kv_a.fp8"], v["kv_a.scale_inv"], "p", method)) is None
    # a scale already re-laid out ([2, 5] for a [576, 256] weight) is not read as the checkpoint's
    assert (
        dump_vllm._fp8_block_layer(Fp8Linear(v["kv_a.fp8"], v["kv_a.scale_inv"].T.contiguous(), "p")) is None
    )


def test_quantization_info_names_the_method_kernel_block_and_moe_backend():
    v = vectors()

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fused_qkv_a_proj = Fp8Linear(v["kv_a.fp8"], v["kv_a.scale_inv"], "a")

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = Attn()
            self.experts = torch.nn.Module()
            self.experts.quant_method = Fp8MoEMethod()

    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.layers = torch.nn.ModuleList([Layer()])
    assert dump_vllm.quantization_info(root) == {
        "linear_method": "Fp8LinearMethod",
        "linear_kernel": "CutlassFp8BlockScaledMMKernel",
        "weight_block_size": [128, 128],
        "weight_dtype": "float8_e4m3fn",
        "scale_dtype": "float32",
        "moe_method": "Fp8MoEMethod",
        "moe_backend": "TRITON",
    }

    # a stand-in kernel that says its arithmetic (the CPU harness's, mla_diff_hooks.fp8_cpu)
    class TorchBlockFp8Kernel(Fp8BlockScaledMMLinearKernel):
        compute = "weight-only"

    attn = root.model.layers[0].self_attn
    attn.fused_qkv_a_proj.quant_method = Fp8LinearMethod(TorchBlockFp8Kernel())
    got = dump_vllm.quantization_info(root)
    assert got["linear_kernel"] == "TorchBlockFp8Kernel" and got["compute"] == "weight-only"
    assert dump_vllm._fp8_block_layer(attn.fused_qkv_a_proj)[3] == "TorchBlockFp8Kernel"
    attn.fused_qkv_a_proj = torch.nn.Linear(4, 4)
    assert dump_vllm.quantization_info(root) is None


def test_act_quant_declares_token_groups_of_the_block_width_unless_weight_only():
    cutlass = {
        "linear_method": "Fp8LinearMethod",
        "linear_kernel": "CutlassFp8BlockScaledMMKernel",
        "weight_block_size": [128, 128],
    }
    assert dump_vllm.act_quant_field(cutlass, "bf16") == {
        "dtype": "fp8_e4m3",
        "granularity": "token-group",
        "group": 128,
        "input": "bf16",
    }
    # the group is the block's width along the input dim (weight_block_size [bn, bk])
    assert dump_vllm.act_quant_field({**cutlass, "weight_block_size": [64, 32]}, "f32")["group"] == 32
    # the CPU stand-in in its w8a8-block mode quantizes as the GPU kernels do
    assert dump_vllm.act_quant_field({**cutlass, "compute": "w8a8-block"}, "f32")["input"] == "f32"
    # weight-only arithmetic, a Marlin kernel, no block size, no fp8 method: nothing declared
    assert dump_vllm.act_quant_field({**cutlass, "compute": "weight-only"}, "f32") is None
    marlin = {**cutlass, "linear_kernel": "MarlinFp8ScaledMMLinearKernel"}
    assert dump_vllm.act_quant_field(marlin, "bf16") is None
    assert dump_vllm.act_quant_field({"linear_method": "Fp8LinearMethod"}, "bf16") is None
    assert dump_vllm.act_quant_field({"linear_method": "GGUFLinearMethod"}, "bf16") is None
    assert dump_vllm.act_quant_field(None, "bf16") is None
    # a mixed-dtype dump names no input dtype
    assert "input" not in dump_vllm.act_quant_field(cutlass, "bf16,f32")


def test_kv_cache_quant_declares_an_e4m3_cache_with_the_layers_scale():
    class Mla(torch.nn.Module):
        def __init__(self, kd, scale):
            super().__init__()
            self.kv_cache_dtype = kd
            self._k_scale = torch.tensor(scale)
            self._k_scale_float = scale

    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.attn = Mla("fp8", 0.0625)
    assert dump_vllm.kv_cache_quant_field(root, "bf16") == {
        "dtype": "fp8_e4m3",
        "scale": 0.0625,
        "input": "bf16",
    }
    root.model.attn = Mla("fp8_e4m3", 1.0)
    assert dump_vllm.kv_cache_quant_field(root, "f32")["scale"] == 1.0
    # the tensor when the float mirror is missing
    del root.model.attn._k_scale_float
    assert dump_vllm.kv_cache_quant_field(root, "f32")["scale"] == 1.0
    # an unquantized cache and formats the field does not describe
    for kd in ("auto", "bfloat16", "fp8_e5m2", "fp8_ds_mla"):
        root.model.attn = Mla(kd, 1.0)
        assert dump_vllm.kv_cache_quant_field(root, "bf16") is None, kd
    root.model.attn = torch.nn.Linear(2, 2)
    assert dump_vllm.kv_cache_quant_field(root, "bf16") is None


def test_kv_cache_quant_declares_the_fp8_decode_query_where_the_backend_takes_one():
    class Impl:
        def __init__(self, takes):
            self.supports_quant_query_input = takes

    class Mla(torch.nn.Module):
        def __init__(self, takes, q_scale):
            super().__init__()
            self.kv_cache_dtype = "fp8"
            self._k_scale = torch.tensor(0.5)
            self._k_scale_float = 0.5
            self._q_scale = torch.tensor(q_scale)
            self._q_scale_float = q_scale
            self.impl = Impl(takes)

    root = torch.nn.Module()
    root.attn = Mla(True, 0.25)  # FLASHMLA: the query quantized with the layer's q_scale
    assert dump_vllm.kv_cache_quant_field(root, "bf16") == {
        "dtype": "fp8_e4m3",
        "scale": 0.5,
        "input": "bf16",
        "query": {"scale": 0.25},
    }
    del root.attn._q_scale_float
    assert dump_vllm.kv_cache_quant_field(root, "bf16")["query"] == {"scale": 0.25}
    root.attn = Mla(False, 0.25)  # TRITON_MLA: a bf16 query over the fp8 cache
    assert "query" not in dump_vllm.kv_cache_quant_field(root, "bf16")


# ---- model identity -----------------------------------------------------------------------


def raw_layer_sha(folder, n: int) -> str:
    """The layer hash recomputed with safetensors: every `model.layers.{n}.` tensor's bytes, by name."""
    tensors = {}
    for shard in folder.glob("model-*.safetensors"):
        tensors.update(safetensors_torch.load_file(str(shard)))
    h = hashlib.sha256()
    for name in sorted(k for k in tensors if k.startswith(f"model.layers.{n}.")):
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def test_hf_identity_hashes_config_and_index_and_each_layer_s_bytes():
    ident = dump_format.model_identity(FP8, [0, 1])
    cfg, idx = (FP8 / "config.json").read_bytes(), (FP8 / "model.safetensors.index.json").read_bytes()
    shards = sorted(set(json.loads(idx)["weight_map"].values()))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert ident == {
        "file": "hf-v3-fp8",
        "format": "hf-safetensors",
        "bytes": len(cfg) + len(idx) + sum((FP8 / s).stat().st_size for s in shards),
        "index_sha256": hashlib.sha256(cfg + idx).hexdigest(),
        "layer_sha256": {"0": raw_layer_sha(FP8, 0), "1": raw_layer_sha(FP8, 1)},
    }
    assert ident["bytes"] == 1403 + 6271 + 1266464 + 2058768


def test_hf_identity_sees_a_changed_scale_in_its_layer_only(tmp_path):
    folder = tmp_path / "hf-v3-fp8"
    folder.mkdir()
    for name in (
        "config.json",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ):
        shutil.copy(FP8 / name, folder / name)
    before = dump_format.model_identity(folder, [0, 1])
    shard = folder / "model-00001-of-00002.safetensors"
    tensors = safetensors_torch.load_file(str(shard))
    s = tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"] = plants.transposed_scale_grid(s)
    safetensors_torch.save_file(tensors, str(shard))
    after = dump_format.model_identity(folder, [0, 1])
    assert after["index_sha256"] == before["index_sha256"]
    assert after["layer_sha256"]["1"] == before["layer_sha256"]["1"]
    assert after["layer_sha256"]["0"] != before["layer_sha256"]["0"]
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        dump_format.model_identity(folder, [0])


# ---- the plant --------------------------------------------------------------------------------


def test_transposed_scale_grid_moves_blocks_as_a_loader_reading_the_other_order():
    s = torch.tensor([[1.0, 2, 3, 4], [5, 6, 7, 8]])  # o_proj's [2, 4] grid
    assert plants.transposed_scale_grid(s).tolist() == [[1, 5, 2, 6], [3, 7, 4, 8]]
    sq = torch.tensor([[1.0, 2], [3, 4]])
    assert torch.equal(plants.transposed_scale_grid(sq), sq.t())
    ck = checkpoint("model.layers.0.self_attn.")
    moved = {
        p: int(
            (plants.transposed_scale_grid(ck[f"{p}.weight_scale_inv"]) != ck[f"{p}.weight_scale_inv"]).sum()
        )
        for p in ("o_proj", "kv_b_proj", "q_b_proj")
    }
    assert moved == {"o_proj": 6, "kv_b_proj": 28, "q_b_proj": 0}  # q_b's [6, 1]: nothing moves


def test_fp8_scale_transposed_plants_its_layer_after_loading(fake_vllm, monkeypatch):
    monkeypatch.setattr(plants, "_APPLIED", {})
    monkeypatch.setattr(plants, "SCALE_PLANTED", [])
    entry = plants.apply("fp8-scale-transposed")
    assert entry["name"] == "plant:fp8-scale-transposed"
    assert entry["params"] == {"layer": "0", "param": "o_proj"}
    ck = checkpoint("model.layers.0.self_attn.")
    make = lambda p, pre: Fp8Linear(ck[f"{p}.weight"].view(torch.uint8), ck[f"{p}.weight_scale_inv"], pre)  # noqa: E731
    o = make("o_proj", "model.layers.0.self_attn.o_proj")
    other = make("o_proj", "model.layers.1.self_attn.o_proj")
    kv_b = make("kv_b_proj", "model.layers.0.self_attn.kv_b_proj")
    for layer in (o, other, kv_b):
        layer.quant_method.process_weights_after_loading(layer)
    s = ck["o_proj.weight_scale_inv"]
    assert torch.equal(o.weight_scale_inv.data, s.t().contiguous().view(2, 4))
    assert torch.equal(other.weight_scale_inv.data, s)
    assert torch.equal(kv_b.weight_scale_inv.data, ck["kv_b_proj.weight_scale_inv"])
    assert plants.SCALE_PLANTED == [{"layer": "model.layers.0.self_attn.o_proj", "grid": [2, 4], "moved": 6}]
    # the weights dump then holds the blocks scaled by the moved scales
    w, _ = dump_vllm.dequant_weight(o, torch.bfloat16)
    codes = ck["o_proj.weight"].float().numpy()
    assert np.array_equal(w[:128, 128:256], codes[:128, 128:256] * s[1, 0].item())  # block (0, 1) <- (1, 0)
    assert np.array_equal(w[128:, 384:], codes[128:, 384:] * s[1, 3].item())  # block (1, 3) stays


def test_fp8_scale_transposed_refuses_a_grid_it_cannot_change(fake_vllm, monkeypatch):
    monkeypatch.setattr(plants, "_APPLIED", {})
    monkeypatch.setattr(plants, "SCALE_PLANTED", [])
    plants.apply("fp8-scale-transposed:param=q_b_proj")
    ck = checkpoint("model.layers.0.self_attn.q_b_proj.")
    q_b = Fp8Linear(
        ck["weight"].view(torch.uint8), ck["weight_scale_inv"], "model.layers.0.self_attn.q_b_proj"
    )
    with pytest.raises(ValueError, match=r"q_b_proj's scale grid \[6, 1\] is unchanged by the relayout"):
        q_b.quant_method.process_weights_after_loading(q_b)
