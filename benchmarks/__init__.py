"""Benchmark scripts, run as ``python benchmarks/<name>.py``; a package only so that ``lint-imports``
holds them to the same contracts as the library (no ``graftblock.cli``, public APIs only)."""
