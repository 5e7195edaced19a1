"""mpfused's benchmarks. A package so that the scripts share harness.py and goals.py (and each other's
helpers) through ordinary imports, with no path edits: run them from the repository root as
``python -m benchmarks.bench_<name> [--device cpu|cuda] [--quick] [--json]`` (``make bench`` runs them all),
with mpfused importable from there (the in-place build of ``make build``, or an installed mpfused)."""
