"""One configuration's training run and what is measured during it (bench/TRAINING.md, "Columns").

Every rank runs the same loop: step ``s`` takes the rank's slice of the global batch of ``s``
and times forward + backward + optimizer step + the loss read-back (which waits for the step
to finish). Nothing is communicated inside a step besides what the engine does; losses and
times are combined once at the end: a step's time is the slowest rank's, the train loss the
mean over ranks (= the global batch's, since the slices are equal).
"""

from __future__ import annotations

import functools
import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from bench.harness.dist_env import DistContext
from bench.harness.timing import reduce_over_ranks
from bench.harness.wire import read_wire_bytes

from .data import ByteCorpus, rank_slice
from .runner import Runner


@dataclass(frozen=True, kw_only=True)
class LoopSettings:
    """Steps, batch and evaluation of every configuration's run (the flags of the same names)."""

    steps: int = 40
    warmup: int = 5  # leading steps left out of the step time and wire bytes (still trained on)
    batch: int = 8  # global, in sequences; must split evenly over the ranks
    seq_len: int = 128
    seed: int = 0
    eval_every: int = 0  # validate every this many steps (0: only after the last step)
    eval_batches: int = 4

    def __post_init__(self) -> None:
        for name, low in (("steps", 1), ("batch", 1), ("seq_len", 1), ("eval_batches", 1), ("eval_every", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"warmup must be in [0, steps={self.steps}), got {self.warmup}")


@dataclass(kw_only=True)
class ConfigResult:
    """What one configuration measured (bench/TRAINING.md, "Columns"). ``status``: "ok", "skipped" (an
    optional dependency is missing), "failed" (a peer engine raised) or "expected failure" (it raised
    where it is known to); ``note`` then says why. The figures from ``min_step_s`` on are :mod:`.rounds`'."""

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
    rounds: list[dict[str, Any]] = field(default_factory=list)


class WireMeter:
    """Inter-node bytes of the measured steps: the first rank of every node reads its node's uplink
    counters at the edges of the measured steps, with barriers there so every rank's traffic of
    those steps has finished (validation in between is left out)."""

    def __init__(self, ctx: DistContext) -> None:
        self.reads, self.device = ctx.env.first_in_node, ctx.device
        self.tx = self.rx = 0
        self.missing = False
        self.mark: tuple[int, int] | None = None

    def start(self) -> None:
        dist.barrier()
        self.mark = read_wire_bytes() if self.reads else None

    def stop(self) -> None:
        dist.barrier()
        if self.reads:
            now = read_wire_bytes()
            if self.mark is None or now is None:
                self.missing = True
            else:
                self.tx, self.rx = self.tx + now[0] - self.mark[0], self.rx + now[1] - self.mark[1]

    def totals(self) -> tuple[int, int, int] | None:
        """Sent and received summed over nodes (each inter-node byte once) and the busiest node's
        larger direction, or None when any node could not read its counters."""
        tx, rx, missing = reduce_over_ranks([self.tx, self.rx, self.missing], dist.ReduceOp.SUM, device=self.device)
        (busiest,) = reduce_over_ranks([max(self.tx, self.rx)], dist.ReduceOp.MAX, device=self.device)
        return None if missing else (int(tx), int(rx), int(busiest))


def evaluate(runner: Runner, batches: list[torch.Tensor], ctx: DistContext) -> float:
    """Mean validation loss over the global batches (every rank evaluates its slice)."""
    world = ctx.env.world_size
    local = sum(runner.eval_loss(rank_slice(b, ctx.env.rank, world).to(ctx.device)) for b in batches)
    return reduce_over_ranks([local], dist.ReduceOp.SUM, device=ctx.device)[0] / (world * len(batches))


def run_config(name: str, model: str, make_runner: Callable[[], Runner], corpus: ByteCorpus, ctx: DistContext,
               settings: LoopSettings, on_step: Callable[[int], None] | None = None) -> ConfigResult:  # fmt: skip
    """Train one configuration from the seed and measure it (collective); ``on_step(step)`` after each step."""
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
        losses, times, val_curve = _train(runner, meter, corpus, ctx, settings, on_step)
        return _summarize(name, model, losses, times, val_curve, runner.memory(), meter.totals(), ctx, settings)
    finally:
        runner.close()


def _train(runner: Runner, meter: WireMeter, corpus: ByteCorpus, ctx: DistContext, settings: LoopSettings,
           on_step: Callable[[int], None] | None) -> tuple[list[float], list[float], list[tuple[int, float]]]:
    """This rank's losses and step times, and the validation curve."""
    val_batches = corpus.val_batches(batch=settings.batch, num_batches=settings.eval_batches)
    losses, times, val_curve = [], [], []
    for step in range(1, settings.steps + 1):
        if step - 1 == settings.warmup:
            meter.start()
        global_batch = corpus.train_batch(step - 1, batch=settings.batch, seed=settings.seed)
        tokens = rank_slice(global_batch, ctx.env.rank, ctx.env.world_size).to(ctx.device)
        began = time.perf_counter()
        losses.append(runner.train_step(tokens))
        times.append(time.perf_counter() - began)
        if on_step is not None:
            on_step(step)
        if settings.eval_every and step % settings.eval_every == 0 and step < settings.steps:
            measuring = step > settings.warmup
            if measuring:
                meter.stop()
            val_curve.append((step, evaluate(runner, val_batches, ctx)))
            if measuring:
                meter.start()
    meter.stop()
    return losses, times, [*val_curve, (settings.steps, evaluate(runner, val_batches, ctx))]


def _summarize(name: str, model: str, losses: list[float], times: list[float], val_curve: list[tuple[int, float]],
               memory: tuple[int | None, str], wire: tuple[int, int, int] | None, ctx: DistContext,
               settings: LoopSettings) -> ConfigResult:  # fmt: skip
    reduce = functools.partial(reduce_over_ranks, device=ctx.device)
    train_losses = [total / ctx.env.world_size for total in reduce(losses, dist.ReduceOp.SUM)]
    slowest = reduce(times, dist.ReduceOp.MAX)
    (peak,) = reduce([-1 if memory[0] is None else memory[0]], dist.ReduceOp.MAX)  # -1: MAX keeps any rank's figure
    tx, rx, busiest = (None,) * 3 if wire is None else (count / (settings.steps - settings.warmup) for count in wire)
    return ConfigResult(config=name, model=model, median_step_s=statistics.median(slowest[settings.warmup:]),
                        wire_tx_bytes_per_step=tx, wire_rx_bytes_per_step=rx, wire_busiest_bytes_per_step=busiest,
                        memory_bytes=None if peak < 0 else int(peak), memory_source=memory[1],
                        first_loss=train_losses[0], last_loss=train_losses[-1], val_loss=val_curve[-1][1],
                        train_losses=train_losses, val_curve=val_curve, step_times_s=slowest)  # fmt: skip
