"""The benchmarks, each a module run as `python -m benchmarks.NAME` from the
repository root; benchmarks/harness.py says how one is written."""
