"""A multi-node cluster simulated on one machine with Linux network namespaces (needs root): ``python -m
bench.simcluster --num-nodes N --local-size L --rate 200mbit -- CMD ...`` runs ``CMD`` as ``N * L`` ranks
(:mod:`.config` what to simulate, :mod:`.network` the nodes and links, :mod:`.launcher` the ranks)."""
