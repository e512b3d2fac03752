"""The harness every benchmark suite shares (nccl-tests' ``common``), device-aware throughout.

* :mod:`.dist_env`: who this rank is under which launcher, its device and backend, joining the group;
* :mod:`.collective`: what one collective's spec file declares, and its buffers on the rank's device;
* :mod:`.checking`: seeded inputs, the fp64 oracle and the error bounds behind ``#wrong``;
* :mod:`.timing`: barrier-synchronised timing, host clock on the CPU, CUDA events on a GPU;
* :mod:`.bandwidth`: nccl-tests' algbw / busbw and a ring's inter-node bytes;
* :mod:`.wire`: a node's uplink counters under ``bench.simcluster``;
* :mod:`.report`: the collectives' rows as a table, JSON and a plot;
* :mod:`.flags`: flag values in nccl-tests' spelling (sizes with K/M/G);
* :mod:`.checkout`: running ``bench`` from the checkout (it is not installed).

Nothing is re-exported here, so a suite (or ``bench.gpu_check``, which must start without
torch) imports only the modules it uses.
"""
