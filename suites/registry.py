"""Suite registry: names → suites, and one entry point ``run_suite`` for the CLI and the sweep runner.

Generation suites: ``gsm8k``, ``gsm8k_cot``, ``gsm8k_chat``, ``aime24``, ``aime25``, ``gpqa_diamond``, and
``ruler`` (synthetic long-context tasks built with the target's tokenizer, options in ``opts.extra``: see
suites/ruler/params.py).  ``fidelity`` needs a reference (``FidelityContext``); ``lm_eval:<task>`` runs any
lm-eval task.
``--protocol`` picks a variant of a suite (``gsm8k`` + ``cot`` → ``gsm8k_cot``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from kvbench.core import Client
from kvbench.suites.base import GenerationTask, SuiteError, SuiteOptions, SuiteResult


def _gsm8k() -> GenerationTask:
    from kvbench.suites.gsm8k import Gsm8k

    return Gsm8k()


def _gsm8k_cot() -> GenerationTask:
    from kvbench.suites.gsm8k import Gsm8kCot

    return Gsm8kCot()


def _gsm8k_chat() -> GenerationTask:
    from kvbench.suites.gsm8k import Gsm8kChat

    return Gsm8kChat()


def _aime(name: str) -> Callable[[], GenerationTask]:
    def make() -> GenerationTask:
        from kvbench.suites.aime import Aime

        return Aime(name)

    return make


def _gpqa() -> GenerationTask:
    from kvbench.suites.gpqa import GpqaDiamond

    return GpqaDiamond()


GENERATION_SUITES: dict[str, Callable[[], GenerationTask]] = {
    "gsm8k": _gsm8k,
    "gsm8k_cot": _gsm8k_cot,
    "gsm8k_chat": _gsm8k_chat,
    "aime24": _aime("aime24"),
    "aime25": _aime("aime25"),
    "gpqa_diamond": _gpqa,
}
# suite -> {protocol: concrete suite}
PROTOCOLS: dict[str, dict[str, str]] = {
    "gsm8k": {"lm-eval": "gsm8k", "5shot": "gsm8k", "cot": "gsm8k_cot", "8shot-cot": "gsm8k_cot", "chat": "gsm8k_chat"},
}
# suites built for one client (they need its tokenizer and context length)
CLIENT_SUITES = ("ruler",)
SPECIAL = ("fidelity", "lm_eval:<task>")


# What the rest of kvbench asks about a suite, declared here rather than as ``if name == ...`` elsewhere:
# the metric it is reported, paired and gated on (``correct`` unless named: ruler scores the fraction of expected
# strings found, ``scores.ruler``), whether it needs a reference configuration (fidelity), and the checker of its
# ``params`` run when a sweep config loads (raises SuiteError).
PRIMARY_METRICS = {"ruler": "ruler"}
REFERENCE_SUITES = ("fidelity",)


def _ruler_params(params: dict) -> None:
    from kvbench.suites.ruler.params import parse_params

    parse_params(params)


PARAM_CHECKS: dict[str, Callable[[dict], None]] = {"ruler": _ruler_params}
# the `kvbench eval` flags each suite takes, as {param: flag}: the param the flag's value becomes in the suite's
# options (``SuiteOptions.extra``); a flag given without a suite that takes it is a usage error
SUITE_FLAGS: dict[str, dict[str, str]] = {
    "ruler": {"context_lengths": "--context-lengths", "depths": "--depths", "tasks": "--ruler-tasks",
              "haystack": "--haystack", "haystack_file": "--haystack-file", "prompt_style": "--prompt-style",
              "tokenizer": "--tokenizer"},
    "fidelity": {"text_tokens": "--fidelity-text-tokens", "position_buckets": "--position-buckets",
                 "haystack_file": "--haystack-file"},
}
# a suite takes a flag only together with another of its flags: (suite, param) -> the param it needs
SUITE_FLAG_REQUIRES: dict[tuple[str, str], str] = {("fidelity", "haystack_file"): "text_tokens"}
# flags whose value must be a positive number
SUITE_FLAG_POSITIVE = {("fidelity", "text_tokens"), ("fidelity", "position_buckets")}


def primary_metric(name: str) -> str:
    """The metric suite ``name`` is reported, compared and gated on by default."""
    return PRIMARY_METRICS.get(name, "correct")


def needs_reference(name: str) -> bool:
    """Whether suite ``name`` compares each cell with a reference configuration (``FidelityContext``)."""
    return name in REFERENCE_SUITES


def check_params(name: str, params: dict) -> None:
    """Check suite ``name``'s ``params`` as a sweep config gives them (``SuiteError`` names the bad key)."""
    check = PARAM_CHECKS.get(name)
    if check is not None:
        check(params)


def suite_names() -> list[str]:
    """Every suite name the CLI and the sweep configuration take (``lm_eval:<task>`` stands for any task)."""
    return [*GENERATION_SUITES, *CLIENT_SUITES, *SPECIAL]


def is_suite_name(name: str) -> bool:
    """A concrete suite of this registry, or ``lm_eval:<task>`` with a task."""
    if name.startswith("lm_eval:"):
        return len(name) > len("lm_eval:")
    return name in GENERATION_SUITES or name in CLIENT_SUITES or name in SPECIAL


# suites whose prompt can be phrased several ways (``prompt_style``) -> the module holding PROMPT_STYLES
_PROMPT_STYLE_MODULES = {"gpqa_diamond": "gpqa", "aime24": "aime", "aime25": "aime"}
PROMPT_STYLE_SUITES = tuple(_PROMPT_STYLE_MODULES)


def prompt_styles(name: str) -> tuple[str, ...]:
    """The ``prompt_style`` values suite ``name`` takes (empty when it has none)."""
    mod = _PROMPT_STYLE_MODULES.get(name)
    if mod is None:
        return ()
    import importlib

    return tuple(importlib.import_module(f"kvbench.suites.{mod}").PROMPT_STYLES)


def resolve(name: str, protocol: Optional[str] = None) -> str:
    """Concrete suite name for ``name`` under ``protocol`` (None = the suite's default)."""
    if name.startswith("lm_eval:"):
        if not name[len("lm_eval:") :]:
            raise SuiteError("lm_eval:<task> needs a task name, e.g. lm_eval:gsm8k")
        return name
    if not is_suite_name(name):
        raise SuiteError(f"unknown suite {name!r}; choose one of: {', '.join(suite_names())}")
    if protocol is None:
        return name
    variants = PROTOCOLS.get(name)
    if not variants or protocol not in variants:
        have = ", ".join(sorted(variants)) if variants else "none (only the default)"
        raise SuiteError(f"suite {name!r} has no protocol {protocol!r}; protocols: {have}")
    return variants[protocol]


@dataclass
class FidelityContext:
    """How the fidelity suite finds its reference (see suites/fidelity/suite.py)."""

    label: str
    make_client: Callable[[], Client]
    cache_dir: Optional[Path] = None
    exact: bool = False
    top_k: int = 64
    greedy_tokens: int = 32
    key: Optional[object] = None  # the reference's identity for the cache key (a dict, or a callable giving one: harness/fidelity_key.py)


@dataclass
class RunContext:
    fidelity: Optional[FidelityContext] = None
    lm_eval_include: Optional[str] = None  # extra lm-eval task directory
    extra: dict = field(default_factory=dict)


def run_suite(name: str, client: Client, opts: SuiteOptions, ctx: Optional[RunContext] = None) -> SuiteResult:
    ctx = ctx or RunContext()
    if name.startswith("lm_eval:"):
        from kvbench.suites.lm_eval_bridge import run_lm_eval

        return run_lm_eval(name[len("lm_eval:") :], client, opts, include_path=ctx.lm_eval_include)
    if needs_reference(name):
        if ctx.fidelity is None:
            raise SuiteError("the fidelity suite needs a reference configuration")
        from kvbench.suites.fidelity.suite import FidelitySuite, Reference

        f = ctx.fidelity
        suite = FidelitySuite(Reference(f.label, f.make_client, f.key), f.cache_dir, f.top_k, f.greedy_tokens, f.exact)
        return suite.run(client, opts)
    from kvbench.suites.runner import run_generation

    if name == "ruler":
        from kvbench.suites.ruler.suite import make_ruler

        return run_generation(make_ruler(client, opts), client, opts)
    if name not in GENERATION_SUITES:
        raise SuiteError(f"unknown suite {name!r}; choose one of: {', '.join(suite_names())}")

    return run_generation(GENERATION_SUITES[name](), client, opts)
