"""kvbench.suites.ruler: The RULER-style long-context suite: tasks, haystacks, params, the fit of prompts to lengths."""
