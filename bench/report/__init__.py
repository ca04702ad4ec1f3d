"""Benches of distmem.report (run each as `python bench/report/NAME.py`)."""
