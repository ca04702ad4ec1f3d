"""Benches of distmem.comm (run each as `python bench/comm/NAME.py`)."""
