"""Benches of distmem's native cap (run each as `python bench/native/NAME.py`)."""
