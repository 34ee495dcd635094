"""Checks and benchmarks of the kernels and the engine, on top of the library (docs/design.md §9): nothing in
``kvbench.kernels`` / ``runtime`` / ``suites`` / ``reports`` / ``core`` imports them.

- ``kernel_check``  Triton KV kernels against float64 references (``python -m kvbench.tools.kernel_check``)
- ``kernel_bench``  kernel benchmarks with flashinfer and SDPA anchors (``kvbench bench kernels``)
- ``prefill_bench`` / ``decode_bench`` / ``append_bench``  the parts of ``kernel_bench``
- ``mla_check``     MLA latent-cache kernels: checks and benchmarks (``kvbench bench mla``)
- ``engine_perf``   engine decode step, capacity and backend matrix (``python -m kvbench.tools.engine_perf``)
  (its measurements in ``engine_measure``)
- ``streaming``     rows printed as they are measured, with a progress line on stderr
- ``engine_bundle`` an engine (vLLM) carried to a machine without a package index, in parts (standard library
  only: ``python3 tools/engine_bundle.py build|unpack|verify|env``; manifests in ``tools/bundles/``)
- ``gguf_to_hf``    a GGUF checkpoint as an HF directory for engines that load those (``python -m kvbench.tools.gguf_to_hf``)
"""
