"""The harness every benchmark suite shares (nccl-tests' ``common``), device-aware throughout.

Its modules are listed in docs/architecture.md ("bench: suites over one harness"). Nothing is
re-exported here, so a suite (or ``bench.gpu_check``, which must start without torch) imports
only the modules it uses.
"""
