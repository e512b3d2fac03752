"""Byte-level language-modelling data from the Python standard library's own sources (bench/TRAINING.md, "Data").

Every machine that runs this benchmark has a Python installation, so its standard library is
real text that needs no download. The split depends only on file names (the SHA-256 of the
relative path), so it is fixed and disjoint; a NUL byte, never in source text, separates files.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import numpy as np
import torch

SEPARATOR = 0
VOCAB_SIZE = 256


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_source_files(root: Path) -> list[str]:
    """Relative paths of the ``*.py`` files under ``root``, sorted, without site-packages."""
    return sorted(
        path.relative_to(root).as_posix()
        for path in root.rglob("*.py")
        if "site-packages" not in path.relative_to(root).parts and path.is_file()
    )


def is_validation_file(relative_path: str, val_fraction: float) -> bool:
    """Whether the first 8 bytes of the path's SHA-256, as a fraction of 2**64, fall below ``val_fraction``."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < val_fraction * 2**64


class ByteCorpus:
    """The train and validation byte streams of the ``*.py`` files under ``root`` (None: the standard
    library) and the samplers over them; a sample predicts ``seq_len`` tokens."""

    def __init__(self, seq_len: int, *, val_fraction: float = 0.1, root: str | Path | None = None) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int):
            raise TypeError(f"seq_len must be an int, got {seq_len!r}")
        if seq_len < 1 or not 0.0 < val_fraction < 1.0:
            raise ValueError(f"need seq_len >= 1 and val_fraction in (0, 1), got {seq_len} and {val_fraction}")
        root = Path(root) if root is not None else stdlib_root()
        files = list_source_files(root)
        self.val_files = [name for name in files if is_validation_file(name, val_fraction)]
        self.train_files = [name for name in files if not is_validation_file(name, val_fraction)]
        if not self.train_files or not self.val_files:
            raise ValueError(f"{root} gives {len(self.train_files)} training and {len(self.val_files)} validation "
                             f"files at val_fraction={val_fraction}; both must be non-empty")  # fmt: skip
        self.window = seq_len + 1  # a sample: seq_len predicted tokens and the one before them
        self.train, self.val = (np.frombuffer(bytes([SEPARATOR]).join((root / name).read_bytes() for name in files),
                                              dtype=np.uint8) for files in (self.train_files, self.val_files))
        for name, stream in (("training", self.train), ("validation", self.val)):
            if stream.size < self.window:
                raise ValueError(f"the {name} stream has {stream.size} bytes, fewer than one window ({self.window})")

    def train_batch(self, step: int, *, batch: int, seed: int) -> torch.Tensor:
        """The global batch of ``step``: ``(batch, seq_len + 1)`` int64 tokens from a generator seeded with
        ``(seed, step)``, so every rank computes the same batch without communicating."""
        offsets = np.random.default_rng([seed, step]).integers(0, self.train.size - self.window + 1, size=batch)
        return self._windows(self.train, offsets)

    def val_batches(self, *, batch: int, num_batches: int) -> list[torch.Tensor]:
        """``num_batches`` global batches of evenly spaced validation windows (fixed, no seed)."""
        offsets = np.linspace(0, self.val.size - self.window, num=batch * num_batches).astype(np.int64)
        return list(self._windows(self.val, offsets).split(batch))

    def _windows(self, stream: np.ndarray, offsets: np.ndarray) -> torch.Tensor:
        rows = np.stack([stream[start : start + self.window] for start in offsets])
        return torch.from_numpy(rows.astype(np.int64))


def rank_slice(global_batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s contiguous rows of a global batch; the slices partition it."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    rows = global_batch.shape[0]
    if rows % world_size:
        raise ValueError(f"global batch of {rows} rows does not split evenly over {world_size} ranks")
    per_rank = rows // world_size
    return global_batch[rank * per_rank : (rank + 1) * per_rank]
