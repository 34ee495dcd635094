"""The ground floor (kvbench.core): the format and backend tables, and every other list derived from them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvbench.core.backends import BackendSpec, assert_supported, backend_names, is_supported, supported_formats
from kvbench.core.formats import FORMAT_SPECS, FormatSpec, format_names, get_spec, plain_names, quantized_names


def test_builtin_table():
    assert format_names() == ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "nvfp4")
    assert plain_names() == ("bf16", "fp16") and quantized_names() == ("fp8_e4m3", "fp8_e5m2", "nvfp4")
    nv = get_spec("nvfp4")
    assert nv.bytes_per_element == 0.5625 and nv.bytes_per_token(128) == 72 and nv.packed_dim(128) == 64
    assert nv.blocks(128) == 8 and nv.head_dim_error(40) == "nvfp4 needs head_dim divisible by 16 (got 40)"
    assert get_spec("fp8_e5m2").bytes_per_token(128) == 128 and get_spec("bf16").token_scale_bytes == 0
    with pytest.raises(ValueError, match="unknown KV format 'int4'; supported: bf16, fp16, fp8_e4m3, fp8_e5m2, nvfp4"):
        get_spec("int4")


@pytest.mark.parametrize("kw, msg", [
    (dict(name="x4", element_bits=4, storage="uint8"), "do not fill one uint8"),
    (dict(name="x8", element_bits=8, storage="int8", block_size=16), "block_size and block_scale go together"),
    (dict(name="x9", element_bits=8, storage="int8", quantized=True), "a quantized format has a max_value"),
    (dict(name="Bad-Name", element_bits=16, storage="float16"), "lower-case"),
    (dict(name="x7", element_bits=8, storage="int7"), "unknown storage"),
])
def test_format_spec_is_checked(kw, msg):
    with pytest.raises(ValueError, match=msg):
        FormatSpec(**kw)


def test_duplicate_format_refused():
    from kvbench.core.formats import register_format

    with pytest.raises(ValueError, match="'bf16' is already registered"):
        register_format(FormatSpec("bf16", 16, "bfloat16"))
    assert len(FORMAT_SPECS) == 5


def test_backend_table_matches_the_old_support_lists():
    assert backend_names() == ("torch", "triton", "flashinfer")
    assert supported_formats("flashinfer", "prefill") == ("bf16", "fp16")
    assert supported_formats("flashinfer", "decode") == ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2")
    assert supported_formats("flashinfer") == ("bf16", "fp16")  # both phases
    assert supported_formats("triton", mla=True) == format_names() and supported_formats("flashinfer", mla=True) == ()
    assert not is_supported("nope", "bf16", "decode") and not is_supported("torch", "bf16", "verify")
    with pytest.raises(ValueError, match=r"the flashinfer backend does not support kv format nvfp4 for decode "
                                         r"\(supported: bf16, fp16, fp8_e4m3, fp8_e5m2\)"):
        assert_supported("flashinfer", "nvfp4", "decode")
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'; known: torch, triton, flashinfer"):
        assert_supported("cuda", "bf16", "decode")
    with pytest.raises(ValueError, match="unknown phase"):
        BackendSpec("x", phases=("verify",))


def test_runtime_registry_reads_the_table():
    from kvbench.runtime.attention.registry import backend_paths, support_table

    assert tuple(backend_paths()) == backend_names()
    table = support_table()
    assert table["torch"]["decode"] == list(format_names())
    assert table["triton"]["prefill"] == list(format_names())


def test_the_old_re_export_homes_are_gone():
    """Each core name has one import path (issue 42): the shims that re-exported the floor were removed."""
    import importlib

    for old in ("kvbench.harness.client", "kvbench.harness.store", "kvbench.harness.loadgen_metrics",
                "kvbench.harness.prompt_tokenizer", "kvbench.runtime.tokenizer"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)


def test_records_schema():
    from kvbench.core.records import ITEM_FIELDS, check_record, missing_fields

    rec = dict.fromkeys(ITEM_FIELDS)
    assert check_record(rec) is rec and missing_fields({"suite": "x"})[:2] == ["item_id", "repeat"]
    with pytest.raises(ValueError, match="item record lacks field.s. correct"):
        check_record({k: v for k, v in rec.items() if k != "correct"})


def test_cli_help_is_generated_from_the_tables():
    code = ("from kvbench.harness.options import ENGINE_PARAMS as P;"
            "print(P['kv_dtype'][1].help); print(P['backend'][1].help); print(P['kv_scales'][1].help)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == ["KV format: bf16, fp16, fp8_e4m3, fp8_e5m2, nvfp4", "Attention backend for both phases: torch, triton, flashinfer",
                   "KV scale source: unit, checkpoint, calibrate"]


def test_suite_names_come_from_the_registry():
    from kvbench.harness.sweep.config import SweepConfigError, parse_config
    from kvbench.suites.registry import is_suite_name, prompt_styles, suite_names

    assert suite_names()[:6] == ["gsm8k", "gsm8k_cot", "gsm8k_chat", "aime24", "aime25", "gpqa_diamond"]
    assert is_suite_name("ruler") and is_suite_name("lm_eval:hellaswag") and not is_suite_name("lm_eval:")
    assert "gpt_oss" in prompt_styles("gpqa_diamond") and prompt_styles("gsm8k") == ()
    with pytest.raises(SweepConfigError, match="'mmlu' is not a known suite; choose one of: gsm8k, .*ruler, fidelity, lm_eval:<task>"):
        parse_config({"suites": ["mmlu"]})
