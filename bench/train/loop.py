"""One configuration's training run and what is measured during it.

Every rank runs the same loop: step ``s`` takes the rank's slice of the global batch of
``s`` (same on all ranks and for all configurations), and times forward + backward +
optimizer step + the loss read-back (which waits for the step to finish). Nothing is
communicated inside a step besides what the engine itself does; losses and times are
gathered once at the end: the step time of a step is the slowest rank's, the train loss
the mean over ranks (= the loss of the global batch, since the slices are equal).

Wire bytes: the first rank of every node reads its node's uplink counters
(:func:`bench.harness.wire.read_wire_bytes`) at the edges of the measured steps (after the warm-up),
with barriers there so every rank's traffic of those steps has finished; validation in
between is left out. The per-node deltas are summed over nodes: ``tx`` summed over nodes
counts each inter-node byte once.

Wire time: every node's link carries its own traffic, each direction at the link's rate,
so the step's traffic needs at least the busiest node's larger direction (``max(tx, rx)``,
the maximum over nodes) divided by the link's measured throughput
(:func:`bench.harness.link.measure_link_throughput`). Its fraction of the median step
time tells a communication-bound step (near 1) from a compute-bound one (near 0).
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from bench.harness.dist_env import DistContext
from bench.harness.wire import read_wire_bytes

from .data import ByteCorpus, rank_slice
from .runner import MemoryReading, Runner


@dataclass(frozen=True, kw_only=True)
class LoopSettings:
    """Steps, batch and evaluation of every configuration's run.

    Args:
        steps: optimizer steps per configuration.
        warmup: leading steps left out of the step time and wire bytes (still trained on).
        batch: global batch in sequences; must split evenly over the ranks.
        seq_len: predicted tokens per sequence.
        seed: model initialisation and batch sampling seed.
        eval_every: validate every this many steps (0: only after the last step).
        eval_batches: global batches of the fixed validation set.
    """

    steps: int = 40
    warmup: int = 5
    batch: int = 8
    seq_len: int = 128
    seed: int = 0
    eval_every: int = 0
    eval_batches: int = 4

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "seq_len", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"warmup must be in [0, steps={self.steps}), got {self.warmup}")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0, got {self.eval_every}")


@dataclass(kw_only=True)
class RoundRecord:
    """What one round of a configuration measured (see :mod:`.rounds`): ``round`` is 1-based,
    ``position`` the configuration's 0-based place in that round's order."""

    round: int
    position: int
    median_step_s: float
    step_times_s: list[float]
    wire_tx_bytes_per_step: float | None
    wire_rx_bytes_per_step: float | None
    wire_busiest_bytes_per_step: float | None
    memory_bytes: int | None
    train_losses: list[float]
    val_curve: list[tuple[int, float]]

    @classmethod
    def of(cls, row: "ConfigResult", *, round: int, position: int) -> "RoundRecord":
        assert row.status == "ok" and row.median_step_s is not None, row.status
        return cls(round=round, position=position, median_step_s=row.median_step_s, step_times_s=row.step_times_s,
                   wire_tx_bytes_per_step=row.wire_tx_bytes_per_step, wire_rx_bytes_per_step=row.wire_rx_bytes_per_step,
                   wire_busiest_bytes_per_step=row.wire_busiest_bytes_per_step, memory_bytes=row.memory_bytes,
                   train_losses=row.train_losses, val_curve=row.val_curve)  # fmt: skip

    def losses(self) -> list[float]:
        """Every loss of the round, train then validation, in a fixed order (to compare rounds)."""
        return [*self.train_losses, *(loss for _, loss in self.val_curve)]


@dataclass(kw_only=True)
class ConfigResult:
    """What one configuration measured.

    ``status`` is "ok", "skipped" (an optional dependency is missing), "failed" (a peer
    engine raised) or "expected failure" (it raised where it is known to, e.g. DeepSpeed's
    ZeRO++ on a CPU); ``note`` then says why. ``wire_busiest_bytes_per_step`` is the busiest
    node's larger direction; ``wire_time_s`` and ``wire_fraction`` (of the median step) are
    None without wire counters or a measured link throughput.

    Over several rounds (:mod:`.rounds`) ``median_step_s`` and the wire columns are medians
    over the rounds, ``min_step_s``/``max_step_s`` the rounds' extremes, losses and
    ``step_times_s`` the first round's, ``rounds`` every round's record, ``loss_max_diff``
    the largest loss difference between a round and the first (None: one round), and
    ``paired_ratios`` the per-round ratios to ``baseline``'s row of the same model with their
    median ``ratio_to_baseline`` and range ``ratio_min``/``ratio_max``. With one round these
    are the same run's figures (the ratio is the plain ratio of medians).
    """

    config: str
    model: str
    status: str = "ok"
    note: str = ""
    median_step_s: float | None = None
    tokens_per_s: float | None = None
    wire_tx_bytes_per_step: float | None = None
    wire_rx_bytes_per_step: float | None = None
    wire_busiest_bytes_per_step: float | None = None
    wire_time_s: float | None = None
    wire_fraction: float | None = None
    memory_bytes: int | None = None
    memory_source: str = ""
    first_loss: float | None = None
    last_loss: float | None = None
    val_loss: float | None = None
    train_losses: list[float] = field(default_factory=list)
    val_curve: list[tuple[int, float]] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    min_step_s: float | None = None
    max_step_s: float | None = None
    loss_max_diff: float | None = None
    baseline: str | None = None
    ratio_to_baseline: float | None = None
    ratio_min: float | None = None
    ratio_max: float | None = None
    paired_ratios: list[float] = field(default_factory=list)
    rounds: list[RoundRecord] = field(default_factory=list)


class WireTotals(NamedTuple):
    """Inter-node bytes of the measured steps: sent and received summed over nodes, and the
    busiest node's larger direction."""

    tx: int
    rx: int
    busiest: int


class WireMeter:
    """Inter-node bytes of the measured steps (see the module docstring)."""

    def __init__(self, ctx: DistContext) -> None:
        self.reads = ctx.env.first_in_node
        self.device = ctx.device
        self.tx = self.rx = 0
        self.missing = False
        self.mark: tuple[int, int] | None = None

    def start(self) -> None:
        dist.barrier()
        if self.reads:
            self.mark = read_wire_bytes()
            self.missing |= self.mark is None

    def stop(self) -> None:
        dist.barrier()
        if self.reads and self.mark is not None:
            now = read_wire_bytes()
            if now is None:
                self.missing = True
            else:
                self.tx += now[0] - self.mark[0]
                self.rx += now[1] - self.mark[1]
        self.mark = None

    def totals(self) -> WireTotals | None:
        """The totals over nodes, or None when any node could not read its counters."""
        summed = torch.tensor([self.tx, self.rx, int(self.missing)], dtype=torch.int64, device=self.device)
        dist.all_reduce(summed)
        busiest = torch.tensor([max(self.tx, self.rx)], dtype=torch.int64, device=self.device)
        dist.all_reduce(busiest, op=dist.ReduceOp.MAX)
        tx, rx, missing = summed.tolist()
        return None if missing else WireTotals(tx, rx, int(busiest.item()))


def evaluate(runner: Runner, batches: list[torch.Tensor], ctx: DistContext) -> float:
    """Mean validation loss over the global batches (every rank evaluates its slice)."""
    world = ctx.env.world_size
    local = sum(runner.eval_loss(rank_slice(b, ctx.env.rank, world).to(ctx.device)) for b in batches)
    total = torch.tensor([local], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(total)
    return total.item() / (world * len(batches))


def _eval_due(step: int, settings: LoopSettings) -> bool:
    return settings.eval_every > 0 and step % settings.eval_every == 0 and step < settings.steps


@dataclass
class _RankLog:
    """This rank's own measurements, before they are combined across ranks."""

    losses: list[float] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    val_curve: list[tuple[int, float]] = field(default_factory=list)


def run_config(
    name: str,
    model: str,
    make_runner: Callable[[], Runner],
    corpus: ByteCorpus,
    ctx: DistContext,
    settings: LoopSettings,
    link_bytes_per_s: float | None = None,
    on_step: Callable[[int], None] | None = None,
) -> ConfigResult:
    """Train one configuration from the seed and measure it; collective, call on every rank.

    ``link_bytes_per_s`` is the measured throughput of one node's link (None: no wire time).
    ``on_step(step)`` is called after each step (1-based), e.g. to print progress.
    """
    # The engine of the run before is held by reference cycles (module and gradient hooks):
    # free it now, before this one allocates, or R rounds x N configurations of engines could
    # pile up in device memory (see also [Note: gradient hook handles] in zero_runtime.comm._grad_reduce).
    gc.collect()
    if ctx.device.type == "cuda":
        # Each run's CUDA peak is its own, not the largest of the configurations before it.
        torch.cuda.reset_peak_memory_stats(ctx.device)
    torch.manual_seed(settings.seed)
    runner = make_runner()
    try:
        meter = WireMeter(ctx)
        log = _train(runner, meter, corpus, ctx, settings, on_step)
        row = _summarize(name, model, log, runner.memory(), meter.totals(), ctx, settings)
    finally:
        runner.close()
    if row.wire_busiest_bytes_per_step is not None and link_bytes_per_s:
        row.wire_time_s = row.wire_busiest_bytes_per_step / link_bytes_per_s
        row.wire_fraction = row.wire_time_s / row.median_step_s
    return row


def _train(runner: Runner, meter: WireMeter, corpus: ByteCorpus, ctx: DistContext, settings: LoopSettings,
           on_step: Callable[[int], None] | None = None) -> _RankLog:
    val_batches = corpus.val_batches(batch=settings.batch, num_batches=settings.eval_batches)
    log = _RankLog()
    for step in range(settings.steps):
        if step == settings.warmup:
            meter.start()
        global_batch = corpus.train_batch(step, batch=settings.batch, seed=settings.seed)
        tokens = rank_slice(global_batch, ctx.env.rank, ctx.env.world_size).to(ctx.device)
        began = time.perf_counter()
        log.losses.append(runner.train_step(tokens))
        log.times.append(time.perf_counter() - began)
        if on_step is not None:
            on_step(step + 1)
        if _eval_due(step + 1, settings):
            measuring = step >= settings.warmup
            if measuring:
                meter.stop()
            log.val_curve.append((step + 1, evaluate(runner, val_batches, ctx)))
            if measuring:
                meter.start()
    meter.stop()
    log.val_curve.append((settings.steps, evaluate(runner, val_batches, ctx)))
    return log


def _combine(values: list[float], op: dist.ReduceOp, ctx: DistContext) -> list[float]:
    combined = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(combined, op=op)
    return combined.tolist()


def _summarize(
    name: str,
    model: str,
    log: _RankLog,
    memory: MemoryReading,
    wire: WireTotals | None,
    ctx: DistContext,
    settings: LoopSettings,
) -> ConfigResult:
    train_losses = [total / ctx.env.world_size for total in _combine(log.losses, dist.ReduceOp.SUM, ctx)]
    slowest = _combine(log.times, dist.ReduceOp.MAX, ctx)
    # -1 stands for "not measured" so that MAX keeps any rank's real figure.
    (peak,) = _combine([-1 if memory.peak_bytes is None else memory.peak_bytes], dist.ReduceOp.MAX, ctx)
    measured_steps = settings.steps - settings.warmup
    median = statistics.median(slowest[settings.warmup :])
    return ConfigResult(
        config=name,
        model=model,
        median_step_s=median,
        tokens_per_s=settings.batch * settings.seq_len / median,
        wire_tx_bytes_per_step=None if wire is None else wire.tx / measured_steps,
        wire_rx_bytes_per_step=None if wire is None else wire.rx / measured_steps,
        wire_busiest_bytes_per_step=None if wire is None else wire.busiest / measured_steps,
        memory_bytes=None if peak < 0 else int(peak),
        memory_source=memory.source,
        first_loss=train_losses[0],
        last_loss=train_losses[-1],
        val_loss=log.val_curve[-1][1],
        train_losses=train_losses,
        val_curve=log.val_curve,
        step_times_s=slowest,
    )
