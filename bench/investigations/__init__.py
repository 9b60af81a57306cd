"""One-off scripts, each run from the repository root as `python -m bench.investigations.NAME`."""
