"""The runtime's communication: the comm plan and its collective objects.

``_plan`` builds the plan from the configuration; ``_plain`` (torch.distributed),
``_quantized`` (qwZ, qgZ), ``comm._hpz_gather`` (hpZ's secondary partition) and
``comm._all_reduce`` (stage 0's gradient all-reduce) implement the ``AllGather`` /
``ReduceScatter`` contracts of ``zero_runtime._contract`` on zcomm's public API;
``comm._grad_reduce`` buckets gradients and reduces them through the plan. Nothing is
imported here.
"""
