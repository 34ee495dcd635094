"""Prefill / extend benchmarks for ``kvbench bench kernels`` (see ``bench.py``): the Triton paged prefill
against torch SDPA on the dense problem and against flashinfer's paged prefill (bf16 and fp8 KV, when
importable), at the same shapes, in the same run; the 8k prompt also with pointer loads instead of
tensor descriptors (``tma=False``)."""

from __future__ import annotations

from kvbench.kernels.bench import Row, _bench, fi_kv

# Launch configurations (block_m, block_n, block_n_prefix, num_warps, num_stages) timed for every prefill
# row; ``None`` stands for ``paged_prefill``'s own defaults (``prefill.launch_defaults``).
CONFIGS = (None, (128, 64, 64, 8, 3), (128, 128, 128, 8, 2), (128, 128, 128, 8, 3), (128, 64, 128, 8, 3),
           (128, 64, 128, 8, 2), (64, 64, 64, 4, 3), (128, 64, 64, 4, 3), (128, 64, 128, 4, 3))
_KEYS = ("block_m", "block_n", "block_n_prefix", "num_warps", "num_stages")


def _best(run, label):
    """Time ``run(cfg)`` for every configuration → (best µs, its config, the defaults' µs or None)."""
    timed = []
    for cfg in CONFIGS:
        kw = {} if cfg is None else dict(zip(_KEYS, cfg))
        try:
            timed.append((_bench(lambda: run(kw)), cfg))
        except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
            print(f"  {label} {cfg}: {type(e).__name__}: {str(e)[:80]}")
    if not timed:
        return float("nan"), None, None
    t, cfg = min(timed, key=lambda x: x[0])
    dflt = [x for x, c in timed if c is None]
    return t, cfg, (dflt[0] if dflt else None)


def _note(n, cfg, dflt):
    return f"best of {n}: {cfg or 'defaults'}" + (f"; defaults {dflt:.1f} us" if dflt is not None else "")


def _flashinfer_prefill(backend, q, qs, kc, vc, ks, vs, table, b, qlen, seq, page, hq, hk, d, layout="NHD"):
    """flashinfer's paged prefill (causal, bottom-right aligned) over all ``seq`` tokens of each sequence
    in the pages, with one of its backends (``fa2``, ``fa3``) → µs."""
    import torch
    import flashinfer

    npg = seq // page
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, layout, backend=backend)
    kc, vc = fi_kv(kc, vc, layout)
    qo = torch.arange(0, b + 1, dtype=torch.int32, device="cuda") * qlen
    indptr = torch.arange(0, b + 1, dtype=torch.int32, device="cuda") * npg
    indices = table[:, :npg].reshape(-1).contiguous()
    last = torch.full((b,), page, dtype=torch.int32, device="cuda")
    w.plan(qo, indptr, indices, last, hq, hk, d, page, causal=True, q_data_type=q.dtype, kv_data_type=kc.dtype)
    if kc.dtype == torch.bfloat16:
        return _bench(lambda: w.run(q, (kc, vc)))
    sc = dict(k_scale=float(ks[0]), v_scale=float(vs[0]))
    if qs is not None:
        sc["q_scale"] = float(qs[0])
    return _bench(lambda: w.run(q, (kc, vc), **sc))


def bench_prefill(seq=8192, hq=32, hk=8, d=128, page=16, flashinfer=True, layout="HND"):
    """Causal 8k prefill (no prefix) vs torch SDPA on the dense problem; then an extend over a cached
    prefix (batch 4 × (7168 cached + 1024 new)) for bf16, fp8 (bf16 queries split into e4m3 terms or over
    converted K tiles, and fp8 queries) and nvfp4 KV; flashinfer's paged prefill on both problems.  Each
    Triton row is the fastest of ``CONFIGS``."""
    import torch
    import torch.nn.functional as F

    from kvbench.kernels.check import make_cache, random_page_table
    from kvbench.kernels.prefill import paged_prefill

    gen = torch.Generator().manual_seed(2)
    rows, res = [], {}
    flops = 4 * hq * d * seq * seq / 2
    qd = torch.randn(1, hq, seq, d, device="cuda", dtype=torch.bfloat16)
    kd = torch.randn(1, hq, seq, d, device="cuda", dtype=torch.bfloat16)
    vd = torch.randn(1, hq, seq, d, device="cuda", dtype=torch.bfloat16)
    t = _bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True))
    res["sdpa"] = flops / (t * 1e-6) / 1e12
    rows.append(Row(f"prefill torch SDPA causal {seq} {hq} heads D{d} (dense)", t, tflops=res["sdpa"]))
    del qd, kd, vd
    q = torch.randn(seq, hq, d, device="cuda", dtype=torch.bfloat16)
    kn = torch.randn(seq, hk, d, device="cuda", dtype=torch.bfloat16)
    vn = torch.randn(seq, hk, d, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, seq], dtype=torch.int32, device="cuda")
    lens = torch.tensor([seq], dtype=torch.int32, device="cuda")
    npg = seq // page + 2
    kc, kbs, ks, _ = make_cache("bf16", npg, page, hk, d, "cuda", gen, layout)
    vc, vbs, vs, _ = make_cache("bf16", npg, page, hk, d, "cuda", gen, layout)
    table = random_page_table([seq], page, npg, gen, "cuda")
    out = torch.empty_like(q)
    t, cfg, dflt = _best(lambda kw: paged_prefill(q, kn, vn, cu, seq, kc, vc, table, lens, kv_format="bf16",
                                                  out=out, max_prefix_len=0, **kw), "prefill")
    res["triton"] = flops / (t * 1e-6) / 1e12
    rows.append(Row(f"prefill triton causal {seq} {hq}/{hk} D{d} (new tokens only)", t, tflops=res["triton"],
                    note=_note(len(CONFIGS), cfg, dflt)))
    # the same kernel with pointer loads instead of tensor descriptors (what the GPU default replaced)
    t, cfg, dflt = _best(lambda kw: paged_prefill(q, kn, vn, cu, seq, kc, vc, table, lens, kv_format="bf16",
                                                  out=out, max_prefix_len=0, tma=False, **kw), "prefill no-tma")
    rows.append(Row(f"prefill triton causal {seq} {hq}/{hk} D{d} (new tokens only), pointer loads", t,
                    tflops=flops / (t * 1e-6) / 1e12, note=_note(len(CONFIGS), cfg, dflt)))
    if flashinfer:
        for be in ("fa2", "fa3"):
            rows.append(_fi_row(f"prefill flashinfer {be} bf16 causal {seq} (paged)", flops, res["triton"],
                                be, q, None, kc, vc, ks, vs, table, 1, seq, seq, page, hq, hk, d, layout))
    del kc, vc
    # extend over a quantized prefix
    b, new, pre = 4, 1024, seq - 1024
    qx = torch.randn(b * new, hq, d, device="cuda", dtype=torch.bfloat16)
    qsc = (qx.float().abs().amax() / 448).reshape(1)
    q8 = (qx.float() / qsc).to(torch.float8_e4m3fn)
    knx = torch.randn(b * new, hk, d, device="cuda", dtype=torch.bfloat16)
    vnx = torch.randn(b * new, hk, d, device="cuda", dtype=torch.bfloat16)
    cux = torch.arange(0, b + 1, dtype=torch.int32, device="cuda") * new
    lx = torch.full((b,), seq, dtype=torch.int32, device="cuda")
    outx = torch.empty_like(qx)
    fl = b * (4 * hq * d * new * pre + 4 * hq * d * new * new / 2)
    for fmt in ("bf16", "fp8_e4m3", "nvfp4"):
        npg = b * (seq // page) + 2
        kc, kbs, ks, _ = make_cache(fmt, npg, page, hk, d, "cuda", gen, layout)
        vc, vbs, vs, _ = make_cache(fmt, npg, page, hk, d, "cuda", gen, layout)
        table = random_page_table([seq] * b, page, npg, gen, "cuda")
        kv = dict(k_scale=ks, v_scale=vs, k_block_scale=kbs, v_block_scale=vbs, out=outx)
        # an e4m3 prefix with bf16 queries: by default q is split exactly into two e4m3 terms and the scores
        # run as fp8 dots on the stored K; "converted K" is the path that converts every K tile instead
        queries = [("", qx, None, {})] + ([(" converted K", qx, None, dict(fp8_qk=False)), (" fp8 q", q8, qsc, {})]
                                          if fmt == "fp8_e4m3" else [])
        for tag, qq, qs, opt in queries:
            t, cfg, dflt = _best(lambda kw: paged_prefill(qq, knx, vnx, cux, new, kc, vc, table, lx, kv_format=fmt,
                                                          q_scale=qs, max_prefix_len=pre, **kv, **kw, **opt),
                                  f"extend {fmt}{tag}")
            res[f"extend_{fmt}{tag.replace(' ', '_')}"] = t
            rows.append(Row(f"extend triton {fmt} prefix B{b}x({pre}+{new}){tag}", t, tflops=fl / (t * 1e-6) / 1e12,
                            note=_note(len(CONFIGS), cfg, dflt)))
        # flashinfer's fa3 backend runs fp8 KV with fp8 queries only; its fa2 backend takes bf16 queries
        anchors = {"bf16": [("fa2", qx, None, ""), ("fa3", qx, None, "")],
                   "fp8_e4m3": [("fa2", qx, None, ""), ("fa3", q8, qsc, " fp8 q")]}.get(fmt, []) if flashinfer else []
        for be, qq, qs, tag in anchors:
            ours = fl / (res[f"extend_{fmt}{tag.replace(' ', '_')}"] * 1e-6) / 1e12
            rows.append(_fi_row(f"extend flashinfer {be} {fmt} prefix B{b}x({pre}+{new}){tag} (paged)", fl, ours, be,
                                qq, qs, kc, vc, ks, vs, table, b, new, seq, page, hq, hk, d, layout))
        del kc, vc
        torch.cuda.empty_cache()
    return rows, res


def _fi_row(name, flops, ours_tflops, *args):
    """A flashinfer anchor row with the Triton kernel's speed relative to it (or why it is missing)."""
    try:
        t = _flashinfer_prefill(*args)
    except Exception as e:  # noqa: BLE001 - no anchor: flashinfer missing, or no kernel for these dtypes
        msg = " ".join(str(e).split())
        return Row(f"{name} (failed)", float("nan"), note=f"{type(e).__name__}: {msg[:60]} ... {msg[-200:]}")
    tf = flops / (t * 1e-6) / 1e12
    return Row(name, t, tflops=tf, note=f"triton {ours_tflops / tf:.2f}x flashinfer's TFLOP/s")
