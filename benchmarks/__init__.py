"""Benchmarks: `python -m benchmarks.NAME` from the repo root; each prints a table, then one line of JSON; results and setups in benchmarks/results/."""
