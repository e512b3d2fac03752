"""zcomm's benchmark suites, run from the checkout as ``python -m bench.<suite>`` (not installed with zcomm).

What each measures: docs/benchmarks.md; the layout: docs/architecture.md. ``bench`` sits on top
of ``zcomm`` and ``zero_runtime``; nothing below imports it (the runtime's tests import
:mod:`bench.train.models`).
"""
