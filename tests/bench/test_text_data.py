"""bench.train.data: deterministic corpus, disjoint fixed split, global batches sliced by rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.train.data import (
    SEPARATOR,
    ByteCorpus,
    is_validation_file,
    list_source_files,
    rank_slice,
    stdlib_root,
)


@pytest.fixture(scope="module")
def stdlib_corpus() -> ByteCorpus:
    return ByteCorpus(32)


def _write_tree(root: Path, count: int) -> None:
    for index in range(count):
        path = root / f"pkg{index % 3}" / f"mod{index}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"# module {index}\n" + f"value_{index} = {index}\n" * 20)
    (root / "site-packages" / "ignored.py").parent.mkdir()
    (root / "site-packages" / "ignored.py").write_text("not stdlib\n")
    (root / "notes.txt").write_text("not python\n")


def test_stdlib_split_is_disjoint_and_covers_every_file(stdlib_corpus: ByteCorpus) -> None:
    everything = list_source_files(stdlib_root())
    assert not set(stdlib_corpus.train_files) & set(stdlib_corpus.val_files)
    assert sorted(stdlib_corpus.train_files + stdlib_corpus.val_files) == everything
    assert all("site-packages" not in name for name in everything)
    share = len(stdlib_corpus.val_files) / len(everything)
    assert 0.05 < share < 0.15  # val_fraction 0.1 over ~1000+ files


def test_split_depends_only_on_the_name() -> None:
    names = [f"a/b{i}.py" for i in range(200)]
    first = [is_validation_file(name, 0.2) for name in names]
    assert first == [is_validation_file(name, 0.2) for name in names]
    assert 10 < sum(first) < 70
    # A larger fraction only moves files into validation, never out of it.
    assert all(is_validation_file(n, 0.5) for n, v in zip(names, first, strict=True) if v)


def test_corpus_is_deterministic_and_skips_non_sources(tmp_path: Path) -> None:
    _write_tree(tmp_path, 30)
    one, two = (ByteCorpus(16, val_fraction=0.3, root=str(tmp_path)) for _ in range(2))
    assert one.train_files == two.train_files and one.val_files == two.val_files
    names = one.train_files + one.val_files
    assert all(name.endswith(".py") and not name.startswith("site-packages") for name in names)
    assert torch.equal(one.train_batch(3, batch=6, seed=7), two.train_batch(3, batch=6, seed=7))
    assert not torch.equal(one.train_batch(3, batch=6, seed=7), one.train_batch(4, batch=6, seed=7))
    assert not torch.equal(one.train_batch(3, batch=6, seed=7), one.train_batch(3, batch=6, seed=8))
    assert (one.train == SEPARATOR).sum() == len(one.train_files) - 1


def test_batches_are_windows_of_their_own_stream(tmp_path: Path) -> None:
    _write_tree(tmp_path, 30)
    corpus = ByteCorpus(16, val_fraction=0.3, root=str(tmp_path))
    train_bytes, val_bytes = corpus.train.tobytes(), corpus.val.tobytes()
    batch = corpus.train_batch(0, batch=8, seed=0)
    assert batch.shape == (8, 17) and batch.dtype == torch.int64
    assert all(bytes(row.tolist()) in train_bytes for row in batch)
    val = corpus.val_batches(batch=4, num_batches=3)
    assert len(val) == 3 and all(b.shape == (4, 17) for b in val)
    assert all(bytes(row.tolist()) in val_bytes for b in val for row in b)
    assert all(torch.equal(a, b) for a, b in zip(val, corpus.val_batches(batch=4, num_batches=3), strict=True))


def test_stdlib_validation_windows_come_from_validation_files(stdlib_corpus: ByteCorpus) -> None:
    val_bytes = stdlib_corpus.val.tobytes()
    rows = torch.cat(stdlib_corpus.val_batches(batch=4, num_batches=2))
    assert all(bytes(row.tolist()) in val_bytes for row in rows)
    assert rows.max() < 256 and rows.min() >= 0


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_rank_slices_partition_the_global_batch(stdlib_corpus: ByteCorpus, world_size: int) -> None:
    batch = stdlib_corpus.train_batch(5, batch=8, seed=1)
    slices = [rank_slice(batch, rank, world_size) for rank in range(world_size)]
    assert all(s.shape[0] == 8 // world_size for s in slices)
    assert torch.equal(torch.cat(slices), batch)


def test_bad_arguments_are_rejected(tmp_path: Path) -> None:
    batch = torch.zeros(6, 5, dtype=torch.int64)
    with pytest.raises(ValueError, match="evenly"):
        rank_slice(batch, 0, 4)
    with pytest.raises(ValueError, match="rank"):
        rank_slice(batch, 3, 3)
    with pytest.raises(ValueError, match="val_fraction"):
        ByteCorpus(16, val_fraction=1.0)
    with pytest.raises(ValueError, match="seq_len"):
        ByteCorpus(0)
    with pytest.raises(TypeError, match="seq_len"):
        ByteCorpus(3.5)
    (tmp_path / "only.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="non-empty"):
        ByteCorpus(16, root=str(tmp_path))
