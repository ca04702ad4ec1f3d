"""Benches of distmem.estimate (run each as `python bench/estimate/NAME.py`)."""
