"""The estimator's tests measure without leaving measurements behind: the cache folder is off
unless a test names its own (``DISTMEM_MEASURE_CACHE``)."""
from __future__ import annotations

import pytest

__all__: list = []


@pytest.fixture(autouse=True)
def _no_measurement_cache(monkeypatch):
    monkeypatch.setenv("DISTMEM_MEASURE_CACHE", "off")
