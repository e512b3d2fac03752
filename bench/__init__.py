"""zcomm's benchmark suites, run from the checkout as ``python -m bench.<suite>`` (not installed with zcomm).

* :mod:`bench.collectives`: nccl-tests for torch's and zcomm's collectives, one spec file per collective;
* :mod:`bench.kernels`: the kernel benchmark (GB/s against a device copy, CUDA-graph sweep, the variants'
  decisions, ncu targets, static counts);
* :mod:`bench.host_cost`: the host-cost benchmark (calls, the runtime's step, the launchers);
* :mod:`bench.train`: the same training under ZeRO 1-3, ZeRO++, FSDP2 and DeepSpeed;
* :mod:`bench.demo`: ``make demo``, the training comparison on a simulated 2 x 2 cluster;
* :mod:`bench.gpu_check`: the GPU entry point: ``make gpu-check`` (zcomm validated on a CUDA machine in
  5 minutes) and ``make gpu-bench`` (every speed target measured in one call);
* :mod:`bench.simcluster`: a multi-node cluster of network namespaces on one machine;
* :mod:`bench.harness`: what the suites share (launch, device-aware buffers and timing,
  checking, bandwidth, wire counters, report).

Layering: ``bench`` sits on top of ``zcomm``, ``zcomm.quant`` and ``zero_runtime``; nothing
below imports ``bench``. The runtime's tests import the small models of
:mod:`bench.train.models` (tests sit above every layer).
"""
