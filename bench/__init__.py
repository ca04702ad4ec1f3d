"""distmem's benches, in rooms that mirror the package; each prints one JSON line (bench/runner.py)."""
