"""Parameter offload (``offload_param.device`` ``cpu`` or ``nvme``, stage 3): the compute-dtype
shards of the partitioned units live off the training device between uses.

[Note: shard residency] A unit's shard (``unit.shard``, what its gathers read) is *resident*
while its storage holds its values: from the moment a gather needs it until the unit's gathered
buffer is freed, and inside ``resident`` blocks (the optimizer's write-back, checkpoints,
``GatheredParameters``). Otherwise its storage is resized to zero, like a freed ``full``, and
its values live at *home*: a host tensor (``cpu``) or the unit's region of this rank's swap
file (``nvme``). A shard that was written while resident (its ``_version`` moved since it last
matched its home) is written home when it is evicted; one only read is dropped. On a CPU
run ``cpu`` moves nothing: the home of a shard in host memory is the shard itself. A fetch
restores the values the shard had, so it writes through an alias of the storage that does not
move the shard's ``_version``: what is keyed on that version (hpZ's secondary partitions, the
scheduler's check that a gathered buffer follows its shard) stays valid across an eviction.

[Note: parameter swap buffers] NVMe transfers need aligned host memory (see [Note: direct
I/O] in ``swap_file``), so they go through ``buffer_count`` buffers of the largest shard's
size: a read lands in a buffer and is copied into the shard's storage when a gather needs
it; an eviction copies the shard into a buffer and starts its write. A buffer returns to
the pool when its transfer is done, and a write still in flight is waited for before the
same unit is read again (the buffer already holds the values, so they are copied from it).
The scheduler starts reads ahead of its gathers along the first step's trace
(``ParamScheduler``), as far as a free buffer and ``max_in_cpu`` (shard elements resident or
being read) allow, and its gather prefetcher stops at the first unit whose read is not done
(it is gathered on a later use, or on demand), so the reads of the next units overlap the
compute of the current one instead of stalling the thread that issues the gathers.

[Note: matched decisions] Which gathers the scheduler starts, and when, must be the same on
every rank, or their collectives mismatch. So no decision here looks at I/O timing: a read
is started when a buffer is free or the oldest write can be waited for, and a gather may
start once its unit's read has *started* (``on_its_way``; ``fetch`` then waits for the read
if needed), never depending on whether a transfer has *finished*. Every state these
decisions read changes only on scheduler events, which all ranks see in the same order. Every write is complete when the
optimizer step ends (``flush``), so a checkpoint or an exception after it finds the files
whole.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from .._partition import FlatUnit
from ..config import ZeroConfig
from .swap_file import SwapFile, Transfer, aligned_buffer, round_up


@dataclass
class _Home:
    """Where one unit's shard lives between uses, and what is in flight for it."""

    offset: int = 0  # byte offset of its region in the swap file (nvme)
    host: torch.Tensor | None = None  # its host copy (cpu on a GPU run)
    synced: int = -1  # shard._version when its values last equalled the home's (-1: never)
    read: tuple[torch.Tensor, Transfer] | None = None  # (buffer, transfer) of a read in flight
    write: tuple[torch.Tensor, Transfer] | None = None  # (buffer, transfer) of a write in flight
    write_order: int = 0  # when that write started (a counter), so the oldest is waited for first
    reads: int = 0  # reads from the swap file, for tests and reports


class ParamOffload:
    """The homes of ``units``' shards (partitioned units, frozen ones included) and their moves."""

    def __init__(self, *, units: list[FlatUnit], config: ZeroConfig, rank: int) -> None:
        offload = config.offload_param
        assert offload.enabled and all(u.partitioned for u in units)
        self.device = offload.device
        self.max_in_cpu = offload.max_in_cpu
        self.units = units
        self.homes = {id(u): _Home() for u in units}
        self.swap: SwapFile | None = None
        self.buffers: list[torch.Tensor] = []
        self._free_buffers: list[torch.Tensor] = []
        # shard elements resident or being read (nvme; see max_in_cpu): all of them, to start with
        self._in_host = sum(u.shard.numel() for u in units)
        self._writes = 0  # writes started, to order them
        self.bytes_read = self.bytes_written = 0  # swap-file traffic (nvme), for reports
        self._on_host_device = all(u.shard.device.type == "cpu" for u in units)
        pin = offload.pin_memory and torch.cuda.is_available()
        if self.device == "nvme":
            self._init_swap(offload, config, rank, pin)
            return
        for unit in units:
            home = self.homes[id(unit)]
            home.synced = unit.shard._version
            if self._on_host_device:
                home.host = unit.shard
                continue
            home.host = unit.shard.detach().to("cpu")
            home.host = home.host.pin_memory() if pin else home.host
            self._drop(unit)

    def _init_swap(self, offload, config: ZeroConfig, rank: int, pin: bool) -> None:
        largest = max(u.shard.numel() for u in self.units)
        if largest > offload.buffer_size:
            biggest = max(self.units, key=lambda u: u.shard.numel())
            raise ValueError(f"offload_param.buffer_size ({offload.buffer_size} elements) is smaller than the "
                             f"largest parameter shard ({largest} elements, unit of {biggest.names[0]}...): raise "
                             "buffer_size, or lower zcomm_stage3_fuse_numel so units are smaller")
        offset = 0
        for unit in self.units:
            self.homes[id(unit)].offset = offset
            offset += round_up(self._nbytes(unit))
        self.swap = SwapFile(offload.nvme_path, rank=rank, nbytes=offset, aio=config.aio, holds="parameters")
        size = round_up(max(self._nbytes(u) for u in self.units))
        self.buffers = [aligned_buffer(size, pin_memory=pin) for _ in range(offload.buffer_count)]
        self._free_buffers = list(self.buffers)
        try:
            for unit in self.units:
                self._write_home(unit)
                self._drop(unit)
            self.flush()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _nbytes(unit: FlatUnit) -> int:
        return unit.shard.numel() * unit.shard.element_size()

    @property
    def moves_shards(self) -> bool:
        """False for ``cpu`` on a CPU run, where the shards already are in host memory."""
        return not (self.device == "cpu" and self._on_host_device)

    # ----- residency -----
    def is_resident(self, unit: FlatUnit) -> bool:
        return unit.shard.untyped_storage().nbytes() > 0

    def fetch(self, unit: FlatUnit, *, read: bool = True) -> None:
        """Make ``unit``'s shard resident; ``read=False`` when the caller overwrites all of it."""
        if self.is_resident(unit):
            return
        home = self.homes[id(unit)]
        if not read:
            self._cancel_read(unit)
        if self.device == "nvme" and home.read is None:  # a read ahead counted it already
            self._in_host += unit.shard.numel()
        unit.shard.untyped_storage().resize_(self._nbytes(unit))
        if not read:
            home.synced = -1
            return
        if self.device == "cpu":
            self._restore(unit).copy_(home.host, non_blocking=True)
        elif home.write is not None:  # its last values are still in the write's buffer (no read then)
            self._copy_in(unit, home.write[0])
        else:
            if home.read is None:
                self._start_read(unit, self._take_buffer())
            buffer, transfer = home.read
            home.read = None
            try:
                transfer.wait()
                self._copy_in(unit, buffer)
            finally:
                self._free_buffers.append(buffer)
        home.synced = unit.shard._version

    def evict(self, unit: FlatUnit) -> None:
        """Write ``unit``'s shard home if it changed since it was last there, and free it."""
        if not self.moves_shards or not self.is_resident(unit):
            return
        if unit.shard._version != self.homes[id(unit)].synced:
            self._write_home(unit)
        self._drop(unit)

    def on_its_way(self, unit: FlatUnit) -> bool:
        """Whether ``unit``'s shard is resident, in host memory (``cpu``, a write's buffer) or
        being read: its gather may start now (see [Note: matched decisions])."""
        home = self.homes[id(unit)]
        return self.device == "cpu" or self.is_resident(unit) or home.write is not None or home.read is not None

    def prefetch(self, unit: FlatUnit) -> bool:
        """Start reading ``unit``'s shard ahead of its gather (nvme); False when no buffer is
        free or ``max_in_cpu`` is reached (the caller stops walking ahead)."""
        home = self.homes[id(unit)]
        if self.device != "nvme" or self.is_resident(unit) or home.read is not None or home.write is not None:
            return True
        if self._in_host + unit.shard.numel() > self.max_in_cpu:
            return False
        if not self._free_buffers:
            writing = self._writing()
            if not writing:
                return False
            self._finish_write(writing[0])
        self._in_host += unit.shard.numel()
        self._start_read(unit, self._free_buffers.pop())
        return True

    @contextlib.contextmanager
    def resident(self, units: Iterable[FlatUnit], *, overwrite: bool = False) -> Iterator[None]:
        """The shards of ``units`` resident inside the block (units not offloaded, such as
        persistent ones, always are); those it fetched are evicted after it (written home if
        the block wrote them)."""
        fetched = [u for u in units if id(u) in self.homes and not self.is_resident(u)]
        try:
            for unit in fetched:
                self.fetch(unit, read=not overwrite)
            yield
        finally:
            for unit in fetched:
                self.evict(unit)

    def flush(self) -> None:
        """Wait for every write in flight (end of the optimizer step, checkpoints, close)."""
        for unit in self.units:
            self._finish_write(self.homes[id(unit)])

    # ----- transfers -----
    def _start_read(self, unit: FlatUnit, buffer: torch.Tensor) -> Transfer:
        home = self.homes[id(unit)]
        transfer = self.swap.read(home.offset, buffer[: round_up(self._nbytes(unit))])
        home.read = (buffer, transfer)
        home.reads += 1
        self.bytes_read += round_up(self._nbytes(unit))
        return transfer

    def _copy_in(self, unit: FlatUnit, buffer: torch.Tensor) -> None:
        # Blocking: the buffer goes back to the pool right after, and a pinned buffer's
        # asynchronous copy to a GPU could still be reading it when the next read lands in it.
        self._restore(unit).copy_(buffer[: self._nbytes(unit)].view(unit.dtype))

    @staticmethod
    def _restore(unit: FlatUnit) -> torch.Tensor:
        """A tensor over the shard's storage with a version counter of its own: writing the
        home's values back through it leaves ``unit.shard._version`` as it was (see [Note:
        shard residency])."""
        shard = unit.shard
        return shard.new_empty(0).set_(shard.untyped_storage(), shard.storage_offset(), shard.shape)

    def _write_home(self, unit: FlatUnit) -> None:
        home = self.homes[id(unit)]
        if self.device == "cpu":
            home.host.copy_(unit.shard, non_blocking=True)
        else:
            self._finish_write(home)  # two writes of one region in flight could land in either order
            buffer = self._take_buffer()
            buffer[: self._nbytes(unit)].view(unit.dtype).copy_(unit.shard)
            home.write = (buffer, self.swap.write(home.offset, buffer[: round_up(self._nbytes(unit))]))
            self._writes += 1
            home.write_order = self._writes
            self.bytes_written += round_up(self._nbytes(unit))
        home.synced = unit.shard._version

    def _drop(self, unit: FlatUnit) -> None:
        unit.shard.untyped_storage().resize_(0)
        if self.device == "nvme":
            self._in_host -= unit.shard.numel()

    def _cancel_read(self, unit: FlatUnit) -> None:
        """Drop ``unit``'s read ahead (its values are about to be overwritten, or its buffer is needed)."""
        home = self.homes[id(unit)]
        if home.read is not None:
            buffer, transfer = home.read
            home.read = None
            transfer.wait()
            self._free_buffers.append(buffer)
            self._in_host -= unit.shard.numel()

    def _take_buffer(self) -> torch.Tensor:
        """A free buffer: waiting for the oldest write in flight if none is, else taking back a
        read ahead (a unit read ahead of a step may not be gathered before the step writes)."""
        if not self._free_buffers:
            writing = self._writing()
            if writing:
                self._finish_write(writing[0])
            else:
                reading = [u for u in self.units if self.homes[id(u)].read is not None]
                assert reading, "a parameter swap buffer is neither free nor in a transfer"
                self._cancel_read(reading[-1])
        return self._free_buffers.pop()

    def _writing(self) -> list[_Home]:
        """The homes with a write in flight, oldest first."""
        return sorted((h for h in self.homes.values() if h.write is not None), key=lambda h: h.write_order)

    def _finish_write(self, home: _Home) -> None:
        if home.write is not None:
            buffer, transfer = home.write
            home.write = None
            transfer.wait()
            self._free_buffers.append(buffer)

    # ----- reports -----
    def held_bytes(self) -> int:
        """Bytes of shards kept off the training device: host copies (``cpu``; on a CPU run
        these are the shards themselves) or swap-file regions (``nvme``)."""
        if self.device == "cpu":
            return sum(h.host.nbytes for h in self.homes.values())
        return self.swap.nbytes

    def reads(self) -> int:
        return sum(h.reads for h in self.homes.values())

    def close(self) -> None:
        """Finish the writes and remove the swap file (see [Note: swap file lifetime]); idempotent."""
        if self.swap is not None:
            try:
                self.flush()
            finally:
                self.swap.close()


def resident(offload: ParamOffload | None, units: Iterable[FlatUnit], *, overwrite: bool = False):
    """``offload.resident(units)``, or nothing to do without parameter offload."""
    return contextlib.nullcontext() if offload is None else offload.resident(units, overwrite=overwrite)
