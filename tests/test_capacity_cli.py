"""`kvbench capacity` rejects budgets and page sizes the engine would reject; `kvbench bench --help` lists
only subcommands that exist."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from kvbench.harness.cli import app
from kvbench.harness.commands.capacity import capacity_rows
from kvbench.runtime.config import KVCacheSpec
from kvbench.runtime.kv_cache import plan_capacity


def invoke(*args):
    r = CliRunner().invoke(app, [*map(str, args)])
    return r.exit_code, r.stdout + (r.stderr or "")


@pytest.mark.parametrize("argv,needle", [
    (["--kv-budget-gb", "-1"], "--kv-budget-gb must be > 0"),
    (["--kv-budget-gb", "0"], "--kv-budget-gb must be > 0"),
    (["--kv-budget-gb", "nan"], "--kv-budget-gb must be > 0"),
    (["--kv-budget-gb", "inf"], "--kv-budget-gb must be > 0"),
    (["--page-size", "3"], "--page-size must be a positive power of two"),
    (["--page-size", "0"], "--page-size must be a positive power of two"),
    (["--page-size", "-16"], "--page-size must be a positive power of two"),
    (["--page-size", "24", "--json"], "--page-size must be a positive power of two"),
    (["--context", "0"], "--context must be > 0"),
])
def test_capacity_rejects_bad_input(argv, needle):
    code, text = invoke("capacity", *argv)
    assert code == 2, text
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvbench capacity: error: ") and needle in lines[0], text


@pytest.mark.parametrize("page", [1, 16, 32, 256])
def test_capacity_accepts_powers_of_two(page):
    code, text = invoke("capacity", "--kv-budget-gb", "0.5", "--page-size", page, "--json")
    assert code == 0, text
    rows = json.loads(text)
    assert all(r["page_size"] == page and r["num_pages"] > 0 and r["tokens"] > 0 for r in rows)


def test_capacity_rows_and_plan_capacity_validate():
    with pytest.raises(ValueError, match="--kv-budget-gb"):
        capacity_rows("llama-3-8b", -1.0, 4096)
    with pytest.raises(ValueError, match="--page-size"):
        capacity_rows("llama-3-8b", 40.0, 4096, page_size=12)
    spec = KVCacheSpec(32, 8, 128, "bf16", 16)
    for budget in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="budget"):
            plan_capacity(spec, budget, 4096)
    with pytest.raises(ValueError, match="power of two"):  # (whether the spec or plan_capacity says so)
        plan_capacity(KVCacheSpec(32, 8, 128, "bf16", 3), 2**30, 4096)
    assert plan_capacity(spec, 1, 4096).num_pages == 0  # a positive budget below one page: zero pages, no error


def test_bench_help_lists_existing_subcommands():
    code, text = invoke("bench", "--help")
    assert code == 0, text
    subcommands = {cmd.name for g in app.registered_groups if g.name == "bench"
                   for cmd in g.typer_instance.registered_commands}
    assert subcommands == {"kernels", "mla"}
    intro = text.split("Options")[0]
    named = set(re.findall(r"\b(kernels|mla|engine)\b", intro))
    assert "engine" not in named and named == subcommands, intro
