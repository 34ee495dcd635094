"""kvbench.harness.launch: Server launches: option placeholders and flags (options) and the hints for engines that lack a flag."""
