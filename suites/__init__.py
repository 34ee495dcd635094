"""kvbench.suites: the accuracy, long-context (suites/ruler/) and fidelity (suites/fidelity/) suites and their
registry (suites/registry.py: names, protocols, primary metrics, flags).  Entry point: the names below."""

# The package's entry point: the names other packages use, each from the module that defines it, imported
# when first asked for (kvbench.core.lazy_exports), so importing the package costs nothing.
from kvbench.core.lazy import lazy_exports

_EXPORTS = {
    "SuiteError": "base",
    "SuiteInputError": "base",
    "SuiteOptions": "base",
    "DataError": "data",
    "gsm8k_texts": "fidelity.suite",
    "build_long_texts": "fidelity.texts",
    "long_text_spec": "fidelity.texts",
    "token_counter": "fidelity.texts",
    "HFPromptTokenizer": "prompt_tokenizer",
    "RemotePromptTokenizer": "prompt_tokenizer",
    "FidelityContext": "registry",
    "PRIMARY_METRICS": "registry",
    "PROMPT_STYLE_SUITES": "registry",
    "RunContext": "registry",
    "SUITE_FLAGS": "registry",
    "SUITE_FLAG_POSITIVE": "registry",
    "SUITE_FLAG_REQUIRES": "registry",
    "check_params": "registry",
    "is_suite_name": "registry",
    "needs_reference": "registry",
    "primary_metric": "registry",
    "prompt_styles": "registry",
    "resolve": "registry",
    "run_suite": "registry",
    "suite_names": "registry",
}
__all__, __getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
