"""kvbench command line, targets, matrix expansion, runner, load generator and result store."""
__version__ = "0.1.0"
