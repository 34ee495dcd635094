"""Options of the ruler suite (suites/ruler/suite.py): parsing and validation shared by ``kvbench eval`` and the
sweep configuration (``suites: - {name: ruler, params: {...}}``).  Pure Python, no tokenizer, no torch.

Keys (sweep ``params`` / ``SuiteOptions.extra``), with the CLI flag that sets each:

- ``context_lengths`` (``--context-lengths 1024,2048,4k``): target prompt lengths in tokens of the target
  model's tokenizer; a ``k`` suffix multiplies by 1024.  Default 1024, 2048, 4096.
- ``depths`` (``--depths N`` or ``--depths 10,50,90``): an integer N >= 1 spreads N needle depths evenly
  over 0-100% (N = 1 means 50%, N = 2 means 0% and 100%, N = 5 means 0, 25, 50, 75, 100); a list gives
  the percents themselves (each in [0, 100]; ``--depths 50%`` is a one-element list).  Default 5.
- ``tasks`` (``--ruler-tasks``): any of ``TASKS``; default all seven.
- ``haystack`` (``--haystack``): ``auto`` (RULER's choice: the repeated-sentence ``noise`` filler for
  niah_single and vt, the built-in ``essay`` for the other needle tasks), ``noise`` or ``essay``.
- ``haystack_file`` (``--haystack-file``): a UTF-8 text file whose natural text replaces the built-in
  haystacks of the needle and vt tasks (it must exist now; it must hold enough text for the longest
  length, checked when the suite starts).
- ``prompt_style`` (``--prompt-style``): ``chat`` or ``completion``; default chat when the target's
  tokenizer has a chat template, else completion.
- ``tokenizer`` (``--tokenizer``): the tokenizer of an external endpoint (local tokenizer.json / HF
  directory / GGUF file, or a hub name when reachable); default the server's ``/tokenize`` route.
  Embedded targets always use their own tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from kvbench.suites.base import SuiteError

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")
DEPTH_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery")  # one item set per depth
HAYSTACKS = ("auto", "noise", "essay")
PROMPT_STYLES = ("chat", "completion")
PARAM_KEYS = ("context_lengths", "depths", "tasks", "haystack", "haystack_file", "prompt_style", "tokenizer")
DEFAULT_LENGTHS = (1024, 2048, 4096)
DEFAULT_DEPTHS = 5
DEFAULT_LIMIT = 5  # items per (task, length, depth) when --limit is not given
MAX_LENGTH = 1 << 21  # 2M tokens: a sanity bound, far above any model's context today


@dataclass
class RulerParams:
    context_lengths: list[int] = field(default_factory=lambda: list(DEFAULT_LENGTHS))
    depths: list[float] = field(default_factory=lambda: depth_grid(DEFAULT_DEPTHS))
    depth_spec: str = f"n{DEFAULT_DEPTHS}"  # how the depths were given (protocol string)
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    haystack: str = "auto"
    haystack_file: Optional[str] = None
    prompt_style: Optional[str] = None  # None: chat when the tokenizer has a chat template
    tokenizer: Optional[str] = None


def depth_grid(n: int) -> list[float]:
    """N depths spread evenly over 0-100%: N = 1 -> [50], else 0, 100/(N-1), ..., 100."""
    if n == 1:
        return [50.0]
    return [round(100.0 * i / (n - 1), 6) for i in range(n)]


def _err(key: str, msg: str) -> None:
    raise SuiteError(f"ruler {key}: {msg}")


def parse_length(value: Any, key: str = "context_lengths") -> int:
    """``4096``, ``"4096"``, ``"4k"`` (x1024) -> int in [1, MAX_LENGTH]."""
    n: Optional[int] = None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str):
        s = value.strip().lower()
        mult = 1024 if s.endswith("k") else 1
        s = s[:-1] if mult > 1 else s
        if s.isdigit():
            n = int(s) * mult
    if n is None or not 1 <= n <= MAX_LENGTH:
        _err(key, f"expected a token count between 1 and {MAX_LENGTH} (e.g. 4096 or 4k), got {value!r}")
    return n


def parse_lengths(value: Any) -> list[int]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not [x for x in items if str(x).strip()]:
        _err("context_lengths", f"expected a non-empty list of token counts, got {value!r}")
    return sorted({parse_length(x) for x in items if str(x).strip()})


def _percent(value: Any) -> float:
    s = value.strip().rstrip("%") if isinstance(value, str) else value
    try:
        d = float(s)
    except (TypeError, ValueError):
        _err("depths", f"expected a percent in [0, 100], got {value!r}")
    if isinstance(value, bool) or not 0.0 <= d <= 100.0:
        _err("depths", f"a depth must lie in [0, 100] percent, got {value!r}")
    return d


def parse_depths(value: Any) -> tuple[list[float], str]:
    """An int N (or its string) -> N evenly spread depths; a list / comma list / ``"50%"`` -> those percents."""
    if isinstance(value, str) and "," not in value and "%" not in value:
        s = value.strip()
        if not s.lstrip("-").isdigit():
            _err("depths", f"expected a count N >= 1 or a list of percents (e.g. 10,50,90), got {value!r}")
        value = int(s)
    if isinstance(value, int) and not isinstance(value, bool):
        if not 1 <= value <= 101:
            _err("depths", f"the number of depths must be between 1 and 101, got {value}")
        return depth_grid(value), f"n{value}"
    items = [x for x in value.split(",") if x.strip()] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items:
        _err("depths", f"expected a count N >= 1 or a non-empty list of percents, got {value!r}")
    depths = sorted({_percent(x) for x in items})
    return depths, "at" + "-".join(f"{d:g}" for d in depths)


def parse_tasks(value: Any) -> list[str]:
    items = [x.strip() for x in value.split(",") if x.strip()] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not items:
        _err("tasks", f"expected a non-empty list of tasks ({', '.join(TASKS)}), got {value!r}")
    for t in items:
        if t not in TASKS:
            _err("tasks", f"unknown task {t!r}; choose from: {', '.join(TASKS)}")
    return [t for t in TASKS if t in items]  # canonical order, no duplicates


def parse_params(extra: Optional[dict]) -> RulerParams:
    """Validated ``RulerParams`` from ``SuiteOptions.extra`` / sweep ``params``; SuiteError names the key."""
    extra = dict(extra or {})
    unknown = [k for k in extra if k not in PARAM_KEYS]
    if unknown:
        _err(unknown[0], f"unknown option; allowed: {', '.join(PARAM_KEYS)}")
    p = RulerParams()
    if extra.get("context_lengths") is not None:
        p.context_lengths = parse_lengths(extra["context_lengths"])
    if extra.get("depths") is not None:
        p.depths, p.depth_spec = parse_depths(extra["depths"])
    if extra.get("tasks") is not None:
        p.tasks = parse_tasks(extra["tasks"])
    if extra.get("haystack") is not None:
        if extra["haystack"] not in HAYSTACKS:
            _err("haystack", f"{extra['haystack']!r} is not allowed; choose one of: {', '.join(HAYSTACKS)}")
        p.haystack = extra["haystack"]
    if extra.get("prompt_style") is not None:
        if extra["prompt_style"] not in PROMPT_STYLES:
            _err("prompt_style", f"{extra['prompt_style']!r} is not allowed; choose one of: {', '.join(PROMPT_STYLES)}")
        p.prompt_style = extra["prompt_style"]
    for key in ("haystack_file", "tokenizer"):
        v = extra.get(key)
        if v is not None and (not isinstance(v, str) or not v.strip()):
            _err(key, f"expected a non-empty string, got {v!r}")
        setattr(p, key, v)
    if p.haystack_file is not None:
        f = Path(p.haystack_file).expanduser()
        if not f.exists():
            _err("haystack_file", f"{p.haystack_file} does not exist")
        if not f.is_file():
            _err("haystack_file", f"{p.haystack_file} is not a file")
    return p
