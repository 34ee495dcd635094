"""Per-layer, per-kv-head error statistics of a KV-cache format, measured while the engine runs.

``DiagnosticProbe.wrap(backend)`` returns a backend that runs the real one and then, for every layer call,
measures what the cache did to this step's K and V and what that did to the attention output:

* K (after RoPE, as stored) and V, separately, per kv head: the relative error of the stored values
  ``sqrt(Σ(stored − x)² / Σx²)`` (``stored``: the dequantized values read back from the cache at the step's
  slots; ``x``: the exact values in float32), the fraction of values above the largest magnitude the
  format represents with the scale in use (``max_repr``: fp8 ``max · scale``, block-scaled formats
  ``max · max(block scale) · scale``; plain and per-token-scaled formats saturate nothing and have none),
  the fraction of nonzero values stored as zero (flushed), the observed amax and the scale.
* The attention output's error per kv head, ``sqrt(Σ‖out − ref‖² / Σ‖ref‖²)`` pooled over the query
  heads the kv head serves: ``out`` is the backend's output, ``ref`` causal attention of the step's
  queries (RoPE'd, never fp8-rounded) over an exact float32 shadow of the sequence's post-RoPE K and V
  (sliding window, sinks and GQA as in ``attention/base.py``).

Everything accumulates as sums over every step and text (no means of means), on the model device, and is
read once by ``result()``.  One sequence per step (texts run one at a time) and the text must start at
position 0: the shadow holds the whole text (2 · 4 bytes per layer, kv head, head dim and token).  The
wrapper does host syncs, so it is not CUDA-graph capturable (``graph_safe = False``).  MLA layers are
not supported.
"""

from __future__ import annotations

from typing import Optional

import torch

from kvbench.runtime.attention.base import AttentionLayer, AttentionMetadata, apply_rope, layer_pages, layer_rope
from kvbench.runtime.attention.torch_backend import attend_chunked

__all__ = ["DiagnosticProbe", "max_representable", "reference_attention"]


def max_representable(fmt, scale: torch.Tensor) -> Optional[torch.Tensor]:
    """Largest magnitude ``fmt`` stores with the per-head dequant ``scale`` ``[H]`` (float32 ``[H]``), or
    None for formats that saturate nothing (plain formats, formats with per-token scales)."""
    spec = fmt.spec
    if fmt.max_value is None or not spec.tensor_scale or spec.token_scale:
        return None
    top = float(fmt.max_value)
    if fmt.block_scale_dtype is not None:  # the largest block scale times the largest element
        top *= float(torch.finfo(fmt.block_scale_dtype).max)
    return scale.float() * top


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos0: int,
                        layer: AttentionLayer) -> torch.Tensor:
    """Float32 causal attention of queries ``q [Q, H, D]`` at positions ``q_pos0 ..`` over the keys/values
    ``k``, ``v`` ``[S, H_kv, D]`` at positions ``0 .. S − 1`` (``S == q_pos0 + Q``), with the layer's
    softmax scale, sliding window and sinks; returns ``[Q, H, D]``."""
    lo = 0 if layer.sliding_window is None else max(0, q_pos0 - int(layer.sliding_window) + 1)
    return attend_chunked(q.float(), k[lo:].float(), v[lo:].float(), q_pos0, lo, layer.softmax_scale,
                          layer.sliding_window, layer.sinks)


class _Shadow:
    """Exact post-RoPE K and V of one layer's current sequence, by position (grows by doubling)."""

    def __init__(self, like: torch.Tensor):
        self.k = like.new_empty((0, *like.shape[1:]), dtype=torch.float32)
        self.v = self.k
        self.n = 0

    def put(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        end = start + k.shape[0]
        if end > self.k.shape[0] or self.k.is_inference() != torch.is_inference_mode_enabled():
            cap = max(end, 2 * self.k.shape[0], 64)
            nk, nv = self.k.new_empty((cap, *k.shape[1:])), self.v.new_empty((cap, *v.shape[1:]))
            nk[: self.n], nv[: self.n] = self.k[: self.n], self.v[: self.n]
            self.k, self.v = nk, nv
        self.k[start:end], self.v[start:end] = k, v
        self.n = end


class _Plane:
    """Running sums of one plane (K or V) of one layer, per kv head, on the model device."""

    def __init__(self, H: int, device: torch.device):
        z = lambda dt: torch.zeros(H, dtype=dt, device=device)  # noqa: E731
        self.err2, self.ref2 = z(torch.float64), z(torch.float64)
        self.sat, self.flush, self.nonzero = z(torch.int64), z(torch.int64), z(torch.int64)
        self.amax = z(torch.float32)
        self.values = 0
        self.scale: Optional[torch.Tensor] = None
        self.max_repr: Optional[torch.Tensor] = None

    def add(self, x: torch.Tensor, stored: torch.Tensor, scale: torch.Tensor, max_repr: Optional[torch.Tensor]) -> None:
        """``x`` exact, ``stored`` read back, both float32 ``[n, H, D]``."""
        # out of place: the sums stay usable whether or not a later call runs under inference mode
        dims = (0, 2)
        self.err2 = self.err2 + (stored.double() - x.double()).square().sum(dims)
        self.ref2 = self.ref2 + x.double().square().sum(dims)
        ax = x.abs()
        if max_repr is not None:
            self.sat = self.sat + (ax > max_repr[None, :, None]).sum(dims)
        nz = x != 0
        self.nonzero = self.nonzero + nz.sum(dims)
        self.flush = self.flush + (nz & (stored == 0)).sum(dims)
        if x.shape[0]:
            self.amax = torch.maximum(self.amax, ax.amax(dims))
        self.values += x.shape[0] * x.shape[2]
        self.scale = scale.detach().float().clone()
        self.max_repr = None if max_repr is None else max_repr.detach().clone()

    def summary(self, H: int) -> dict:
        n = self.values
        err2, ref2 = self.err2.tolist(), self.ref2.tolist()
        nz, flush, sat = self.nonzero.tolist(), self.flush.tolist(), self.sat.tolist()
        return {
            "rel_err": [(e / r) ** 0.5 if r > 0 else None for e, r in zip(err2, ref2)],
            "saturated": [s / n if n else None for s in sat],
            "flushed": [f / z if z else None for f, z in zip(flush, nz)],
            "amax": [float(a) for a in self.amax.tolist()] if n else [None] * H,
            "scale": [float(s) for s in self.scale.tolist()] if self.scale is not None else [None] * H,
            "max_repr": None if self.max_repr is None else [float(m) for m in self.max_repr.tolist()],
            "values": int(n),
        }


class _Layer:
    def __init__(self, H: int, device: torch.device, fmt_name: str, window: Optional[int]):
        self.format, self.window = fmt_name, window
        self.k, self.v = _Plane(H, device), _Plane(H, device)
        self.attn_err2 = torch.zeros(H, dtype=torch.float64, device=device)
        self.attn_ref2 = torch.zeros(H, dtype=torch.float64, device=device)


class DiagnosticProbe:
    """Per-layer / per-kv-head K, V and attention-output error statistics of the cache format in use."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int):
        self.num_layers, self.num_kv_heads, self.head_dim = int(num_layers), int(num_kv_heads), int(head_dim)
        self._layers: list[Optional[_Layer]] = [None] * self.num_layers
        self._shadows: list[Optional[_Shadow]] = [None] * self.num_layers

    def wrap(self, backend) -> "ProbedBackend":
        """A backend that runs ``backend`` and records every layer call into this probe."""
        return ProbedBackend(self, backend)

    def begin_text(self) -> None:
        """Forget the current sequence (the next step starts a new text at position 0)."""
        self._shadows = [None] * self.num_layers

    # ------------------------------------------------------------------------------------ observe
    def observe(self, q, k, v, out, layer: AttentionLayer, cache, meta: AttentionMetadata) -> None:
        """Record one layer call: pre-RoPE ``q``/``k``/``v`` and the backend's output ``out`` ``[T, H·D]``,
        after the backend appended this step's K/V to ``cache``."""
        if meta.num_seqs != 1:
            raise ValueError(f"diagnostics run one text at a time (one sequence per step); this step has "
                             f"{meta.num_seqs} sequences")
        i, H, Hq, D = layer.layer_idx, layer.num_kv_heads, layer.num_heads, layer.head_dim
        if not 0 <= i < self.num_layers or H != self.num_kv_heads or D != self.head_dim:
            raise ValueError(f"layer {i} ({H} kv heads of {D}) does not match the probe "
                             f"({self.num_layers} layers, {self.num_kv_heads} kv heads of {self.head_dim})")
        n = int(meta.q_lens_cpu[0]) if meta.q_lens_cpu else int(meta.cu_seqlens_q[1] - meta.cu_seqlens_q[0])
        seq_len = int(meta.seq_lens_cpu[0]) if meta.seq_lens_cpu else int(meta.seq_lens[0])
        prefix = seq_len - n
        fmt = getattr(cache, "fmt_of", lambda _i: cache.fmt)(i)
        st = self._layers[i]
        if st is None:
            st = self._layers[i] = _Layer(H, k.device, fmt.name, layer.sliding_window)
        pos = meta.positions[:n]
        rope = layer_rope(meta, layer)
        xk = apply_rope(k[:n].float(), pos, rope)
        xv = v[:n].float()

        # (a)-(d): the stored values of this step's rows against the exact ones
        slots = layer_pages(meta, cache, i)[1][:n]
        keep = slots >= 0
        if not bool(keep.all()):
            slots, xk_s, xv_s = slots[keep], xk[keep], xv[keep]
        else:
            xk_s, xv_s = xk, xv
        sk, sv = cache.read_slots(i, slots, torch.float32)
        for plane, x, stored, scale in ((st.k, xk_s, sk, cache.k_scale[i]), (st.v, xv_s, sv, cache.v_scale[i])):
            plane.add(x, stored, scale, max_representable(fmt, scale))

        # (e): attention over the exact shadow of the whole sequence
        sh = self._shadows[i]
        if sh is None or prefix == 0:
            sh = self._shadows[i] = _Shadow(xk)
        if prefix > sh.n:
            raise ValueError(f"diagnostics need every token of a text from position 0: layer {i} got a step at "
                             f"position {prefix} after {sh.n} tokens (call begin_text() before each text; "
                             "prefix-cache hits are not supported)")
        sh.put(prefix, xk, xv)
        qr = apply_rope(q[:n].float(), pos, rope)
        ref = reference_attention(qr, sh.k[:seq_len], sh.v[:seq_len], prefix, layer)
        cand = out[:n].float().reshape(n, Hq, D)
        g = Hq // H
        st.attn_err2 = st.attn_err2 + (cand.double() - ref.double()).square().reshape(n, H, g, D).sum((0, 2, 3))
        st.attn_ref2 = st.attn_ref2 + ref.double().square().reshape(n, H, g, D).sum((0, 2, 3))

    # ------------------------------------------------------------------------------------- result
    def result(self) -> list[dict]:
        """One entry per layer: ``{"layer", "format", "sliding_window", "k", "v", "attn_rel_err"}`` with
        plain Python values (None where undefined; a layer never seen has format None and no values)."""
        H = self.num_kv_heads
        out = []
        for i, st in enumerate(self._layers):
            if st is None:
                cpu = torch.device("cpu")
                out.append({"layer": i, "format": None, "sliding_window": None, "k": _Plane(H, cpu).summary(H),
                            "v": _Plane(H, cpu).summary(H), "attn_rel_err": [None] * H})
                continue
            err2, ref2 = st.attn_err2.tolist(), st.attn_ref2.tolist()
            out.append({
                "layer": i, "format": st.format,
                "sliding_window": None if st.window is None else int(st.window),
                "k": st.k.summary(H), "v": st.v.summary(H),
                "attn_rel_err": [(e / r) ** 0.5 if r > 0 else None for e, r in zip(err2, ref2)],
            })
        return out


class ProbedBackend:
    """A backend that delegates to ``inner`` and records each ``forward`` into a ``DiagnosticProbe``."""

    graph_safe = False  # host syncs in forward: the engine must decode eagerly

    def __init__(self, probe: DiagnosticProbe, inner):
        self.probe = probe
        self.inner = inner

    def plan(self, meta: AttentionMetadata, cache) -> None:
        return self.inner.plan(meta, cache)

    def forward(self, q, k, v, layer: AttentionLayer, cache, meta: AttentionMetadata):
        out = self.inner.forward(q, k, v, layer, cache, meta)
        self.probe.observe(q, k, v, out, layer, cache, meta)
        return out

    def forward_mla(self, *args, **kwargs):
        raise NotImplementedError("KV diagnostics do not support MLA layers (the latent cache has no separate "
                                  "K and V planes to measure)")

    def __getattr__(self, item):  # name, opts, supports, ... of the wrapped backend
        if item in ("inner", "probe", "decode", "prefill"):  # no hybrid halves: graph checks must see this wrapper
            raise AttributeError(item)
        return getattr(self.inner, item)
