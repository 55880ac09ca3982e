"""Benchmarks: `python -m minidist.bench NAME`. One module per benchmark."""
