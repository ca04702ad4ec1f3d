"""Benches of distmem.plan (run each as `python bench/plan/NAME.py`)."""
