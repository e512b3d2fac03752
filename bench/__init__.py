"""zcomm's benchmark suites, run from the checkout as ``python -m bench.<suite>`` (not installed with zcomm).

What each suite measures: docs/benchmarks.md; the package's layout: docs/architecture.md. Layering:
``bench`` sits on top of ``zcomm``, ``zcomm.quant`` and ``zero_runtime``; nothing below imports
``bench`` (the runtime's tests import the small models of :mod:`bench.train.models`).
"""
