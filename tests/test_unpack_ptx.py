"""The PTX that unpacks fp8 pairs and e2m1 codes on the GPU, run on the CPU by a small emulator of the few
instructions it uses (``mov``, ``prmt``, ``shl``/``shr``, ``and``/``or``, ``cvt.rn.f16x2.e4m3x2``,
``mul.rn.f16x2``).  The GPU check covers the kernels end to end; this pins the bit manipulation itself,
for every byte value, so an edit of the strings cannot pass CI while decoding wrongly."""

import re

import numpy as np
import pytest
import torch

from kvbench.kernels import _triton_utils as U
from kvbench.kernels.formats import E2M1_VALUES

E2M1 = [v for v in E2M1_VALUES] + [-v for v in E2M1_VALUES]


def _f16(bits: int) -> float:
    return float(np.array([bits & 0xFFFF], dtype=np.uint16).view(np.float16)[0])


def _f16_bits(x) -> int:
    return int(np.array([x], dtype=np.float16).view(np.uint16)[0])


def _e4m3(byte: int) -> float:
    return torch.tensor([byte], dtype=torch.uint8).view(torch.float8_e4m3fn).float().item()


def run_ptx(asm: str, inputs: dict) -> dict:
    """Execute ``asm`` (one ``{ ... }`` block) with ``$n`` operands from ``inputs`` (32-bit ints)."""
    regs = dict(inputs)

    def val(tok):
        tok = tok.strip()
        return int(tok, 0) if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", tok) else regs[tok]

    for line in asm.strip().strip("{}").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        args = [a.strip() for a in re.split(r",(?![^{]*})", args)]
        d = args[0]
        if op == "mov.b32" and d.startswith("{"):  # unpack into two 16-bit halves
            lo, hi = [x.strip() for x in d.strip("{}").split(",")]
            regs[lo], regs[hi] = val(args[1]) & 0xFFFF, val(args[1]) >> 16
            continue
        if op == "mov.b32":
            regs[d] = val(args[1]) & 0xFFFFFFFF
        elif op == "prmt.b32":
            data = val(args[1]) | (val(args[2]) << 32)
            sel = val(args[3])
            out = 0
            for k in range(4):
                s = (sel >> (4 * k)) & 0xF
                b = (data >> (8 * (s & 7))) & 0xFF
                if s & 8:  # sign-replicate mode
                    b = 0xFF if b & 0x80 else 0
                out |= b << (8 * k)
            regs[d] = out
        elif op == "shl.b32":
            regs[d] = (val(args[1]) << val(args[2])) & 0xFFFFFFFF
        elif op == "shr.b32":
            regs[d] = val(args[1]) >> val(args[2])
        elif op == "and.b32":
            regs[d] = val(args[1]) & val(args[2])
        elif op == "or.b32":
            regs[d] = val(args[1]) | val(args[2])
        elif op in ("cvt.rn.f16x2.e4m3x2", "cvt.rn.f16x2.e5m2x2"):
            src = val(args[1])
            conv = _e4m3 if "e4m3" in op else (
                lambda b: torch.tensor([b], dtype=torch.uint8).view(torch.float8_e5m2).float().item())
            regs[d] = _f16_bits(conv(src & 0xFF)) | (_f16_bits(conv(src >> 8)) << 16)
        elif op == "mul.rn.f16x2":
            a, b = val(args[1]), val(args[2])
            lo = np.float16(_f16(a)) * np.float16(_f16(b))
            hi = np.float16(_f16(a >> 16)) * np.float16(_f16(b >> 16))
            regs[d] = _f16_bits(lo) | (_f16_bits(hi) << 16)
        else:
            raise AssertionError(f"emulator lacks {op}")
    return regs


def _halves(x: int) -> tuple[float, float]:
    return _f16(x), _f16(x >> 16)


def test_e2m1_bytes_asm_every_byte():
    # four bytes per instance: $0/$1 the low nibbles of bytes (0, 1) / (2, 3), $2/$3 the high nibbles;
    # scales $5 for bytes 0-1, $6 for bytes 2-3, passed times E2M1_SCALE
    rng = np.random.default_rng(0)
    for base in range(0, 256, 4):
        word = sum((base + k) << (8 * k) for k in range(4))
        s = [float(2.0 ** rng.integers(-6, 8)) * float(rng.choice([1, 1.125, 1.5, 1.75])) for _ in range(4)]
        sc = [_f16_bits(x * U.E2M1_SCALE.value) for x in s]
        r = run_ptx(U._E2M1_BYTES_ASM.value, {"$4": word, "$5": sc[0] | (sc[1] << 16), "$6": sc[2] | (sc[3] << 16)})
        got = _halves(r["$0"]) + _halves(r["$1"]) + _halves(r["$2"]) + _halves(r["$3"])
        want = [E2M1[(base + k) & 15] * s[k] for k in range(4)] + [E2M1[(base + k) >> 4] * s[k] for k in range(4)]
        assert list(got) == want, (base, got, want)


def test_e2m1_units_asm_every_unit_byte():
    # two 16-bit units (4 codes each) per instance: output k holds element k of unit 0 (low half) and of
    # unit 1 (high half); one scale per unit
    rng = np.random.default_rng(1)
    for _ in range(300):
        u0, u1 = int(rng.integers(0, 1 << 16)), int(rng.integers(0, 1 << 16))
        s0, s1 = 0.5 * float(rng.integers(1, 9)), 2.0 ** float(rng.integers(-6, 8))
        sc = _f16_bits(s0 * U.E2M1_SCALE.value) | (_f16_bits(s1 * U.E2M1_SCALE.value) << 16)
        r = run_ptx(U._E2M1_UNITS_ASM.value, {"$4": u0 | (u1 << 16), "$5": sc})
        for k in range(4):
            got = _halves(r[f"${k}"])
            assert got == (E2M1[(u0 >> (4 * k)) & 15] * s0, E2M1[(u1 >> (4 * k)) & 15] * s1), (u0, u1, k)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_pairs_asm_every_pair(fmt):
    # one 32-bit register = two int16 units (element 2j low byte, 2j+1 high byte): $0 even, $1 odd elements
    asm = U._E4M3_PAIRS_ASM.value if fmt == "e4m3" else U._E5M2_PAIRS_ASM.value
    dt = torch.float8_e4m3fn if fmt == "e4m3" else torch.float8_e5m2
    conv = lambda b: torch.tensor([b], dtype=torch.uint8).view(dt).float().item()  # noqa: E731
    for b0 in range(256):
        b1, b2, b3 = (b0 * 7 + 3) & 255, (b0 * 13 + 5) & 255, (b0 * 29 + 11) & 255
        r = run_ptx(asm, {"$2": b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)})
        ev, od = _halves(r["$0"]), _halves(r["$1"])
        for got, want in zip(ev + od, (conv(b0), conv(b2), conv(b1), conv(b3))):
            assert got == want or (got != got and want != want), (fmt, b0, got, want)
