"""A multi-node cluster simulated on one machine with Linux network namespaces.

``python -m bench.simcluster --num-nodes N --local-size L --rate 200mbit [--delay 1ms] -- CMD ...``
runs ``CMD`` as ``N * L`` ranks; see :mod:`.network` for the topology, :mod:`.ranks` for what
each rank gets, :mod:`.launcher` for the life cycle.
"""
