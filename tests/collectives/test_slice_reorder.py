"""The reorder permutation, checked by simulating qgZ's 2-hop exchange on labelled data.

Every sub-slice is labelled (source rank, destination rank, stage); the simulation moves
rows exactly as zcomm's hops do (row l' of stage s to local rank l', then chunk n' of the
node's reduced row to node n') and checks that every rank ends with, at stage s, part s
of its own slice from every source, in place.
"""

from itertools import product

import pytest

from zcomm._slice_reorder import first_hop_rows, reorder_permutation


def _labelled_input(src, world, stages):
    """Source ``src``'s input as sub-slice labels: index j*k+s holds (src, j, s)."""
    return [(src, dest, s) for dest in range(world) for s in range(stages)]


def _rows(items, count):
    size = len(items) // count
    return [items[c * size : (c + 1) * size] for c in range(count)]


def _reduce(rows):
    """Element-wise "sum" of equally long rows: each position gathers its labels, which must agree on (dest, stage)."""
    reduced = []
    for position in zip(*rows, strict=True):
        labels = [label for entry in position for label in (entry if isinstance(entry, list) else [entry])]
        assert len({label[1:] for label in labels}) == 1, f"mixed destinations/stages summed: {labels}"
        reduced.append(labels)
    return reduced


def _simulate(nodes, local, stages):
    """Per destination rank and stage, the list of labels that stage's output part was summed from."""
    world = nodes * local
    perm = reorder_permutation(nodes, local, stages)
    assert sorted(perm) == list(range(world * stages))
    sent = {}
    for src in range(world):
        labels = _labelled_input(src, world, stages)
        sent[src] = _rows([labels[p] for p in perm], first_hop_rows(nodes, local, stages))
    result = {}
    for s in range(stages):
        for dest in range(world):
            n, l = divmod(dest, local)
            if local > 1:
                # after the intra hop, rank (m, l) of every node m holds the sum of its node's rows s*L+l,
                # cut into N chunks; chunk n goes to node n
                chunks = [
                    _rows(_reduce([sent[m * local + lp][s * local + l] for lp in range(local)]), nodes)[n]
                    for m in range(nodes)
                ]
            else:
                chunks = [sent[m][s * nodes + n] for m in range(nodes)]
            result[dest, s] = _reduce(chunks)
    return result


@pytest.mark.parametrize("nodes,local,stages", list(product([1, 2, 3], [1, 2, 3, 4], [1, 2, 3, 4])))
def test_two_hop_exchange_lands_every_slice_in_place(nodes, local, stages):
    world = nodes * local
    for (dest, s), positions in _simulate(nodes, local, stages).items():
        assert len(positions) == 1, "each stage part is one sub-slice"
        assert sorted(positions[0]) == [(src, dest, s) for src in range(world)]


def test_paper_2x2_example_swaps_the_middle_slices():
    # ZeRO++ Figure 9: with 2 nodes x 2 GPUs and no pipelining, slices 1 and 2 swap
    assert reorder_permutation(2, 2, 1) == (0, 2, 1, 3)
