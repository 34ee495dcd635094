"""Prefill / extend rows of ``kvbench bench kernels`` (``kernel_bench.py``): the Triton paged prefill against
torch SDPA on the dense problem, flashinfer's paged prefill (bf16 and fp8 KV, when importable) and vLLM's
FlashAttention 3 (``vllm_fa3``, where its library is found on a Hopper GPU), at the same shapes, in the same run,
each anchor's row with kvbench's speed-up over it; the 8k prompt also with pointer loads instead of tensor
descriptors (``tma=False``).

Problems: a causal 8k prefill (no prefix), 8 causal prompts of 1024 (the engine's prefill step under the serving
load), and an extend over a cached prefix (batch 4 × (7168 cached + 1024 new)) for bf16, fp8 (bf16 queries split
into e4m3 terms, over converted K tiles, and fp8 queries) and nvfp4 KV.  Each Triton row is the fastest of ``CONFIGS``.  ``PrefillBench(res, ...).steps()`` gives
the measurements as ``streaming.Step``: each row is printed as soon as it is measured."""

from __future__ import annotations

from typing import Iterator, Optional

from kvbench.tools.common import (Row, bench_formats, bench_us as _bench, causal_name, fi_kv, graph_note,
                                  speedup)
from kvbench.tools.decode_bench import BenchResults
from kvbench.tools.streaming import Step

__all__ = ["CONFIGS", "PrefillBench", "bench_prefill", "workspace_crossover"]

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
        except Exception:  # noqa: BLE001 - a config that does not compile is skipped
            pass
    if not timed:
        return float("nan"), None, None
    t, cfg = min(timed, key=lambda x: x[0])
    dflt = [x for x, c in timed if c is None]
    return t, cfg, (dflt[0] if dflt else None)


def _note(n, cfg, dflt):
    return f"best of {n}: {cfg or 'defaults'}" + (f"; defaults {dflt:.1f} us" if dflt is not None else "")


def _tflops(flops, us):
    return flops / (us * 1e-6) / 1e12


class PrefillBench:
    """The prefill / extend measurements on shared inputs (built on first use).  Results go to ``res.pre``:
    ``triton`` / ``sdpa`` TFLOP/s of the causal prefill, ``prompts_<n>x<len>`` µs of the prompts,
    ``extend_<fmt>[_<tag>]`` µs of the extends, ``fi_<backend>_extend_<fmt>[_<tag>]`` and ``vllm_fa3_extend_<fmt>[_<tag>]``
    µs of flashinfer's and vLLM's FA3 on the same problem."""

    def __init__(self, res: BenchResults, seq=8192, hq=32, hk=8, d=128, page=16, flashinfer=True, layout="HND",
                 formats=None, batch=4, new=1024, prompts=(8, 1024)):
        self.res, self.seq, self.hq, self.hk, self.d, self.page = res, seq, hq, hk, d, page
        self.flashinfer, self.layout = flashinfer, layout
        self.formats = formats or bench_formats()
        self.b, self.new, self.pre = batch, new, seq - new
        self.flops = 4 * hq * d * seq * seq / 2
        self.fl = batch * (4 * hq * d * new * self.pre + 4 * hq * d * new * new / 2)
        self.prompts = prompts  # (sequences, tokens): the engine's prefill step under load (8 x 1024)
        self._causal: dict = {}
        self._extend: dict = {}

    # ------------------------------------------------------------------------------ inputs
    def causal_inputs(self, n: int = 1, length: Optional[int] = None) -> dict:
        """``n`` prompts of ``length`` tokens (default: one of ``seq``), their pages and page table (built once)."""
        import torch

        from kvbench.tools.kernel_check import make_cache, random_page_table

        length = length or self.seq
        if (n, length) not in self._causal:
            hq, hk, d, page, t = self.hq, self.hk, self.d, self.page, n * length
            gen = torch.Generator().manual_seed(2 + n)
            npg = n * (length // page + 1) + 2
            kc, _, ks, _ = make_cache("bf16", npg, page, hk, d, "cuda", gen, self.layout)
            vc, _, vs, _ = make_cache("bf16", npg, page, hk, d, "cuda", gen, self.layout)
            self._causal[(n, length)] = dict(
                q=torch.randn(t, hq, d, device="cuda", dtype=torch.bfloat16),
                kn=torch.randn(t, hk, d, device="cuda", dtype=torch.bfloat16),
                vn=torch.randn(t, hk, d, device="cuda", dtype=torch.bfloat16),
                cu=torch.arange(0, n + 1, dtype=torch.int32, device="cuda") * length,
                lens=torch.full((n,), length, dtype=torch.int32, device="cuda"),
                kc=kc, vc=vc, ks=ks, vs=vs, table=random_page_table([length] * n, page, npg, gen, "cuda"))
        return self._causal[(n, length)]

    def extend_inputs(self, fmt: str) -> dict:
        """The queries and new tokens (shared by every format) and ``fmt``'s cache (built once)."""
        import torch

        from kvbench.tools.kernel_check import make_cache, random_page_table

        b, new, seq, hq, hk, d, page = self.b, self.new, self.seq, self.hq, self.hk, self.d, self.page
        if "qx" not in self._extend:
            qx = torch.randn(b * new, hq, d, device="cuda", dtype=torch.bfloat16)
            qsc = (qx.float().abs().amax() / 448).reshape(1)
            self._extend.update(
                qx=qx, qsc=qsc, q8=(qx.float() / qsc).to(torch.float8_e4m3fn),
                knx=torch.randn(b * new, hk, d, device="cuda", dtype=torch.bfloat16),
                vnx=torch.randn(b * new, hk, d, device="cuda", dtype=torch.bfloat16),
                cux=torch.arange(0, b + 1, dtype=torch.int32, device="cuda") * new,
                lx=torch.full((b,), seq, dtype=torch.int32, device="cuda"))
        if fmt not in self._extend:
            for other in [k for k in self._extend if k in self.formats]:  # one format's caches at a time
                del self._extend[other]
            torch.cuda.empty_cache()
            gen = torch.Generator().manual_seed(20 + self.formats.index(fmt))
            npg = b * (seq // page) + 2
            kc, kbs, ks, _ = make_cache(fmt, npg, page, hk, d, "cuda", gen, self.layout)
            vc, vbs, vs, _ = make_cache(fmt, npg, page, hk, d, "cuda", gen, self.layout)
            self._extend[fmt] = dict(kc=kc, vc=vc, ks=ks, vs=vs, kbs=kbs, vbs=vbs,
                                     table=random_page_table([seq] * b, page, npg, gen, "cuda"))
        return {**self._extend, **self._extend[fmt]}

    # ------------------------------------------------------------------------------ rows
    def _causal_row(self, tma: bool, n: int = 1, length: Optional[int] = None) -> Iterator[Row]:
        import torch

        from kvbench.kernels import PagedKV, PrefillOptions
        from kvbench.kernels import paged_prefill

        length = length or self.seq
        x = self.causal_inputs(n, length)
        out = torch.empty_like(x["q"])
        opt = {} if tma else dict(tma=False)
        kv = PagedKV("bf16", x["kc"], x["vc"])
        t, cfg, dflt = _best(lambda kw: paged_prefill(x["q"], x["kn"], x["vn"], x["cu"], length, kv, x["table"],
                                                      x["lens"], out=out,
                                                      opts=PrefillOptions(max_prefix_len=0, **opt, **kw)), "prefill")
        fl = n * 4 * self.hq * self.d * length * length / 2
        if n == 1 and tma:
            self.res.pre["triton"] = _tflops(self.flops, t)
            self.res.pre["triton_us"] = t
        elif tma:
            self.res.pre[f"prompts_{n}x{length}"] = t
        yield Row(causal_name("triton", n, length, self.hq, self.hk, self.d) + " (new tokens only)"
                  + ("" if tma else ", pointer loads"), t, tflops=_tflops(fl, t), note=_note(len(CONFIGS), cfg, dflt))

    def _sdpa_causal_row(self) -> Iterator[Row]:
        import torch
        import torch.nn.functional as F

        seq, hq, d = self.seq, self.hq, self.d
        qd, kd, vd = (torch.randn(1, hq, seq, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        t = _bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True))
        del qd, kd, vd
        self.res.pre["sdpa"] = _tflops(self.flops, t)
        yield Row(f"prefill torch SDPA causal {seq} {hq} heads D{d} (dense)", t, tflops=self.res.pre["sdpa"],
                  kvbench_x=speedup(t, self.res.pre.get("triton_us")))

    def _fi_causal_row(self, be: str) -> Iterator[Row]:
        x = self.causal_inputs()
        yield _fi_row(f"prefill flashinfer {be} bf16 causal {self.seq} (paged)", self.flops,
                      self.res.pre.get("triton_us"), be, x["q"], None, x["kc"], x["vc"], x["ks"], x["vs"], x["table"],
                      1, self.seq, self.seq, self.page, self.hq, self.hk, self.d, self.layout)

    def _extend_name(self, who: str, fmt: str, tag: str = "") -> str:
        return f"extend {who} {fmt} prefix B{self.b}x({self.pre}+{self.new}){tag}"

    def _extend_row(self, fmt: str, tag: str, fp8_q: bool, opt: dict) -> Iterator[Row]:
        from kvbench.kernels import AttentionParams, PagedKV, PrefillOptions
        from kvbench.kernels import paged_prefill

        x = self.extend_inputs(fmt)
        qq, qs = (x["q8"], x["qsc"]) if fp8_q else (x["qx"], None)
        kv = PagedKV(fmt, x["kc"], x["vc"], x["ks"], x["vs"], x["kbs"], x["vbs"])
        attn, out = AttentionParams(q_scale=qs), x["qx"].clone()
        def run(kw):
            return paged_prefill(qq, x["knx"], x["vnx"], x["cux"], self.new, kv, x["table"], x["lx"], attn=attn,
                                 out=out, opts=PrefillOptions(max_prefix_len=self.pre, **kw, **opt))

        t, cfg, dflt = _best(run, f"extend {fmt}{tag}")
        key = f"extend_{fmt}{tag.replace(' ', '_')}"
        self.res.pre[key] = t
        note = _note(len(CONFIGS), cfg, dflt) + graph_note(self.res.pre, key, lambda: run({}))
        yield Row(self._extend_name("triton", fmt, tag), t, tflops=_tflops(self.fl, t), note=note)

    def _sdpa_extend_row(self) -> Iterator[Row]:
        """torch SDPA on the dense bf16 extend: ``new`` queries per sequence over ``pre + new`` keys, causal
        aligned to the bottom right (``causal_lower_right``, else an explicit mask), GQA through
        ``enable_gqa`` (else K/V repeated to the query heads)."""
        import torch
        import torch.nn.functional as F

        b, new, seq, hq, hk, d = self.b, self.new, self.seq, self.hq, self.hk, self.d
        q = torch.randn(b, hq, new, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hk, seq, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        mask = torch.ones(new, seq, dtype=torch.bool, device="cuda").tril(diagonal=seq - new)
        rep: dict = {}  # K/V repeated to the query heads, made only when the GQA variants are refused
        variants = []
        try:
            from torch.nn.attention.bias import causal_lower_right

            variants.append(("causal_lower_right, enable_gqa", lambda: F.scaled_dot_product_attention(
                q, k, v, attn_mask=causal_lower_right(new, seq), enable_gqa=True)))
        except ImportError:
            pass
        variants.append(("bool mask, enable_gqa", lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=True)))
        variants.append((f"bool mask, K/V repeated to {hq} heads", lambda: F.scaled_dot_product_attention(
            q, rep["k"], rep["v"], attn_mask=mask)))
        err = ""
        for how, fn in variants:
            try:
                if "repeated" in how:
                    rep.update(k=k.repeat_interleave(hq // hk, 1), v=v.repeat_interleave(hq // hk, 1))
                t = _bench(fn)
            except (TypeError, RuntimeError) as e:
                err = f"{type(e).__name__}: {str(e)[:80]}"
                continue
            yield Row(f"{self._extend_name('torch SDPA', 'bf16')} (dense)", t, tflops=_tflops(self.fl, t), note=how,
                      kvbench_x=speedup(t, self.res.pre.get("extend_bf16")))
            break
        else:
            yield Row(f"{self._extend_name('torch SDPA', 'bf16')} (dense, failed)", float("nan"), note=err)
        del q, k, v, rep
        torch.cuda.empty_cache()

    def _fi_extend_row(self, fmt: str, be: str, fp8_q: bool, tag: str) -> Iterator[Row]:
        x = self.extend_inputs(fmt)
        qq, qs = (x["q8"], x["qsc"]) if fp8_q else (x["qx"], None)
        ours = self.res.pre.get(f"extend_{fmt}{tag.replace(' ', '_')}")
        row = _fi_row(f"{self._extend_name(f'flashinfer {be}', fmt, tag)} (paged)", self.fl, ours, be, qq, qs,
                      x["kc"], x["vc"], x["ks"], x["vs"], x["table"], self.b, self.new, self.seq, self.page, self.hq,
                      self.hk, self.d, self.layout)
        if row.us == row.us:  # the anchor's µs, for the targets (kernel_bench.speed_targets)
            self.res.pre[f"fi_{be}_extend_{fmt}{tag.replace(' ', '_')}"] = row.us
        yield row

    def steps(self) -> list[Step]:
        """Every measurement in order: kvbench's row of a problem before its anchors (their speed-up needs it)."""
        from kvbench.tools import vllm_fa3

        fa3 = vllm_fa3.available()
        n, length = self.prompts
        s = [Step(f"prefill triton causal {self.seq}", lambda: self._causal_row(True)),
             Step(f"prefill triton causal {self.seq} pointer loads", lambda: self._causal_row(False)),
             Step(f"prefill torch SDPA causal {self.seq}", self._sdpa_causal_row)]
        if self.flashinfer:
            s += [Step(f"prefill flashinfer {be} causal {self.seq}", lambda be=be: self._fi_causal_row(be))
                  for be in ("fa2", "fa3")]
        if fa3:
            s.append(Step(f"prefill vLLM FA3 causal {self.seq}", lambda: vllm_fa3.causal_row(self, 1, self.seq)))
        s.append(Step(f"prefill triton causal {n}x{length}", lambda: self._causal_row(True, n, length)))
        if fa3:
            s.append(Step(f"prefill vLLM FA3 causal {n}x{length}", lambda: vllm_fa3.causal_row(self, n, length)))
        for fmt in self.formats:
            # an e4m3 prefix with bf16 queries: by default q is split exactly into two e4m3 terms and the scores
            # run as fp8 dots on the stored K; "converted K" is the path that converts every K tile instead
            queries = [("", False, {})] + ([(" converted K", False, dict(fp8_qk=False)), (" fp8 q", True, {})]
                                           if fmt == "fp8_e4m3" else [])
            if fmt == "nvfp4":  # the default dequantizes the prefix once into a workspace; the path it replaced
                queries.append((" in registers", False, dict(prefix_workspace=False)))
            s += [Step(f"extend triton {fmt}{tag} B={self.b} L={self.seq}",
                       lambda fmt=fmt, tag=tag, q8=q8, opt=opt: self._extend_row(fmt, tag, q8, opt))
                  for tag, q8, opt in queries]
            if fmt == "bf16":
                s.append(Step(f"extend torch SDPA bf16 B={self.b} L={self.seq}", self._sdpa_extend_row))
            # flashinfer's fa3 backend runs fp8 KV with fp8 queries only; its fa2 backend takes bf16 queries
            anchors = {"bf16": [("fa2", False, ""), ("fa3", False, "")],
                       "fp8_e4m3": [("fa2", False, ""), ("fa3", True, " fp8 q")]}.get(fmt, []) if self.flashinfer else []
            s += [Step(f"extend flashinfer {be} {fmt}{tag}", lambda fmt=fmt, be=be, q8=q8, tag=tag:
                       self._fi_extend_row(fmt, be, q8, tag)) for be, q8, tag in anchors]
            if fa3 and fmt in ("bf16", "fp8_e4m3"):  # FA3 runs e4m3 pages with e4m3 queries only
                tag = "" if fmt == "bf16" else " fp8 q"
                s.append(Step(f"extend vLLM FA3 {fmt}{tag}", lambda fmt=fmt, tag=tag: vllm_fa3.extend_row(self, fmt, tag)))
        return s


def bench_prefill(res: BenchResults, **kw) -> list[Row]:
    """Every prefill row (``PrefillBench.steps`` run to the end, printed as measured)."""
    from kvbench.tools.streaming import run_steps

    return run_steps(PrefillBench(res, **kw).steps(), fmt=Row.line)


def _flashinfer_prefill(backend, q, qs, kc, vc, ks, vs, table, b, qlen, seq, page, hq, hk, d, layout="NHD"):
    """flashinfer's paged prefill (causal, bottom-right aligned) over all ``seq`` tokens of each sequence
    in the pages, with one of its backends (``fa2``, ``fa3``) → µs."""
    import flashinfer
    import torch

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


def _fi_row(name, flops, ours_us, *args):
    """A flashinfer anchor row with kvbench's speed-up over it (or why it is missing)."""
    try:
        t = _flashinfer_prefill(*args)
    except Exception as e:  # noqa: BLE001 - no anchor: flashinfer missing, or no kernel for these dtypes
        msg = " ".join(str(e).split())
        return Row(f"{name} (failed)", float("nan"), note=f"{type(e).__name__}: {msg[:60]} ... {msg[-200:]}")
    return Row(name, t, tflops=_tflops(flops, t), kvbench_x=speedup(t, ours_us))


def workspace_crossover(formats=("nvfp4", "fp8_e5m2"), new_lens=(16, 64, 128, 256, 512, 1024, 2048), prefix=7168,
                        batch=4, layout="HND") -> list[Row]:
    """The extend over a quantized prefix on the Triton kernel at its launch defaults, with the prefix dequantized
    once into a float16 workspace and in registers, for a range of new-token counts: where
    ``prefill.WORKSPACE_MIN_Q`` comes from.  Each row: the workspace path's µs, the note the in-register µs and their ratio."""
    import torch

    from kvbench.kernels import PagedKV, PrefillOptions
    from kvbench.kernels import paged_prefill

    rows = []
    for fmt in formats:
        for new in new_lens:
            pb = PrefillBench(BenchResults(), seq=prefix + new, new=new, batch=batch, flashinfer=False,
                              layout=layout, formats=[fmt])
            x = pb.extend_inputs(fmt)
            kv = PagedKV(fmt, x["kc"], x["vc"], x["ks"], x["vs"], x["kbs"], x["vbs"])
            out = x["qx"].clone()
            opts = {ws: PrefillOptions(max_prefix_len=prefix, prefix_workspace=ws, wgmma=False) for ws in (True, False)}

            def run(ws, x=x, kv=kv, new=new, out=out, opts=opts):
                return paged_prefill(x["qx"], x["knx"], x["vnx"], x["cux"], new, kv, x["table"], x["lx"], out=out,
                                     opts=opts[ws])

            t_ws, t_reg = _bench(lambda: run(True)), _bench(lambda: run(False))
            row = Row(f"extend {fmt} B{batch}x({prefix}+{new}) prefix workspace", t_ws,
                      note=f"in registers {t_reg:.1f} us; workspace {t_reg / t_ws:.2f}x faster")
            print(row.line(), flush=True)
            rows.append(row)
            del pb, x, kv
            torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvbench.tools.prefill_bench",
                                 description="the prefix workspace against dequantizing in registers, by new tokens")
    ap.add_argument("--formats", default="nvfp4,fp8_e5m2")
    ap.add_argument("--new", default="16,64,128,256,512,1024,2048")
    ap.add_argument("--layout", default="HND", choices=("HND", "NHD"))
    a = ap.parse_args()
    workspace_crossover(tuple(a.formats.split(",")), tuple(int(n) for n in a.new.split(",")), layout=a.layout)
