"""Benches of distmem.guard (run each as `python bench/guard/NAME.py`)."""
