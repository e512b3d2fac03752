"""zcomm benchmark suites (run as ``python -m bench.<suite>``)."""
