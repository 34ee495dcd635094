"""kvbench.suites.fidelity: The token-level fidelity suite: teacher-forced KL against a reference, its texts, cache and tables."""
