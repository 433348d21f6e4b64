"""Benchmarks behind ``python -m jsparse.bench``: each a ratio measured side by side in one run."""
