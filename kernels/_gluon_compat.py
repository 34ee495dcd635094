"""Gluon names that changed between Triton 3.6 (the GPU machines) and 3.9 (CI), resolved once for the Gluon
kernels (``decode_nv4.py``, ``mla_decode_wg.py``)."""

from __future__ import annotations

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import tma

# one bar.sync over the program's warps (named thread_barrier up to Triton 3.6, barrier after)
sync = getattr(gl, "thread_barrier", None) or getattr(gl, "barrier")
# a TMA copy into shared memory (async_copy_global_to_shared up to Triton 3.6, async_load after)
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# an asynchronous copy (cp.async) into shared memory (async_copy_global_to_shared up to 3.6, async_load after)
async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
# shared-memory descriptors' ``reinterpret`` (``_reinterpret`` up to 3.6), chosen inside kernels by this constexpr
NEW_SMEM_API = gl.constexpr(hasattr(async_copy, "async_load"))
