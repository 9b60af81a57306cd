"""The benchmarks, a package so that the investigations can import `bench.common` and `bench.linear_kernels` when run from
the repository root as `python -m bench.investigations.NAME`; the scripts here run as `python bench/NAME.py`."""
