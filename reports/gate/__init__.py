"""kvbench.reports.gate: The gate: checks, the discriminative rules, power planning and its output."""
