"""Benchmarks behind ``python -m jsparse.benchmarks``: each a ratio measured side by side in one
run."""
