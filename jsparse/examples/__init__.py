"""Small, realistic workloads for demos, tests and benchmarks (no downloads: models are trained
here from synthetic data)."""
