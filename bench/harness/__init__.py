"""The harness the benchmark suites share (nccl-tests' ``common``), device-aware throughout. Nothing is
re-exported, so a suite (or ``bench.gpu_check``, which must start without torch) imports only what it uses."""
