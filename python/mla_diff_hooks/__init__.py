"""mla-diff's engine hooks: dump an engine's MLA intermediates for `mla-diff compare`.

Why this exists: `mla-diff compare --model M.gguf --dump D.safetensors` judges what an engine
really computed against mla-diff's float64 reference on the same weights; these modules write D
from inside each engine, in the dump format of mla-diff's docs/dump-format.md:
  * `mla_diff_hooks.vllm`: forward hooks on vLLM's DeepSeek MLA modules (`attach`, or `arm` /
    `finish` through `LLM.apply_model`); `python -m mla_diff_hooks.vllm` runs vLLM end to end;
  * `mla_diff_hooks.hf`: HF transformers DeepSeek-V3 (`capture`; `python -m mla_diff_hooks.hf`);
  * `mla_diff_hooks.llama_cpp`: llama.cpp's graph callback through llama-cpp-python (`Recorder`;
    `python -m mla_diff_hooks.llama_cpp`);
  * `mla_diff_hooks.kernels`: production MLA kernels on `mla-diff run --export-inputs` inputs
    (`python -m mla_diff_hooks.kernels`);
  * `mla_diff_hooks.vllm_cpu`: vLLM's own model code on a CPU, recorded by the vLLM hooks
    (`python -m mla_diff_hooks.vllm_cpu`);
  * `mla_diff_hooks.dump_format`: the dump contract they all write through (site names, format
    strings, writers, model identity), over `mla_diff_hooks.st_io`, the byte-reproducible
    safetensors writer.
docs/engines.md is their reference. Each needs its extra (`pip install 'mla-diff[vllm]'`,
`[hf]`, `[llama-cpp]`, `[kernels]`); importing works without them. The `mla-diff` binary itself
comes with the same `pip install`.
"""
