"""Offload: optimizer states and stage-3 parameters kept on the CPU or NVMe.

``_config`` (the ``offload_optimizer``, ``offload_param``, ``sub_group_size`` and ``aio``
sections), ``_optimizer`` (``OptimizerOffload``: masters and states off the device, the step
fed unit by unit), ``offload._swap_stream`` (the NVMe step's read-ahead / update / write-behind
pipeline), ``_params`` (``ParamOffload``: stage 3's shards at home on the host or NVMe),
``swap_file`` (public: one rank's swap file) and ``cpu_adam`` (public: the fused CPU Adam
step). Nothing is imported here, so that the configuration can read ``_config`` without
loading the offload machinery.
"""
