"""``python -m bench.train``: its flags, and every configuration on every model trained one after another in one launch.

Every rank runs every requested configuration: it re-seeds, rebuilds the model and optimizer
under the configuration's engine (:mod:`.runner`), trains ``--steps`` steps on the same global
batches (:mod:`.data`) and measures them (:mod:`.loop`), ``--rounds`` times in alternating order
(:mod:`.rounds`). Rank 0 prints the table and writes JSON and PNGs (:mod:`.report`). Launching
it: bench/TRAINING.md, "Running it".
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import sys
import time
from typing import TextIO

import torch
import torch.distributed as dist

from bench.harness import dist_env
from bench.harness.dist_env import DistContext
from bench.harness.link import measure_link_throughput
from bench.harness.precision import DTYPE_CHOICES, agreed_precision, cpu_model, read_cpuinfo

from .configs import CONFIGS, EngineSetup, TrainConfig, engine_config, select_configs
from .data import VOCAB_SIZE, ByteCorpus
from .loop import ConfigResult, LoopSettings, run_config
from .models import MODELS, GPTConfig, ModelSpec, Unavailable, model_spec
from .report import RunFacts, report
from .rounds import RoundPlan, attach_ratios, combine, round_record
from .runner import RUNNERS, EngineFailed

DEFAULT_CONFIGS = ("zero3", "zeropp", "fsdp2")


def add_training_args(parser: argparse.ArgumentParser, **defaults: object) -> None:
    """The model shape and training flags of ``bench.train`` and ``bench.train.weight_error``."""
    for flag, kind, default, text in (
        ("--seq-len", int, 128, "predicted tokens per sequence"), ("--d-model", int, 128, None),
        ("--n-layers", int, 4, None), ("--n-heads", int, 4, None), ("--steps", int, 40, None),
        ("--batch", int, 8, "global batch in sequences"), ("--lr", float, 1e-3, None), ("--seed", int, 0, None),
    ):  # fmt: skip
        parser.add_argument(flag, type=kind, default=default, help=text)
    parser.add_argument("--json", metavar="PATH", help="write the results and run metadata as JSON")
    parser.set_defaults(**defaults)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.train", description="The same training under several "
                                     "ZeRO/ZeRO++/FSDP2/DeepSpeed setups (see bench/TRAINING.md).")  # fmt: skip
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), metavar="NAME",
                        help=f"default: {' '.join(DEFAULT_CONFIGS)}; any of {' '.join(CONFIGS)} (bench/TRAINING.md)")
    parser.add_argument("--model", nargs="+", choices=MODELS, default=["tinygpt"])
    add_training_args(parser)
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                        help="compute/communication precision of every configuration; auto: bf16 on a GPU or a CPU "
                        "with native bf16 (AMX/AVX512-BF16), else fp32")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of time and wire bytes")
    parser.add_argument("--grad-clip", type=float, default=0.0,
                        help="max global gradient norm, given to every engine alike (0: off)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1, help="train every configuration this many times, in "
                        "alternating order, ratios to --baseline paired per round (bench/TRAINING.md, Rounds)")
    parser.add_argument("--baseline", metavar="NAME",
                        help="the configuration the paired step-time ratios divide by (default: the first)")
    parser.add_argument("--eval-every", type=int, default=0, help="validate every N steps (0: only at the end)")
    parser.add_argument("--eval-batches", type=int, default=4, help="global batches of the validation set")
    parser.add_argument("--plot-dir", metavar="DIR", help="write loss_vs_step.png and step_time.png")
    return parser


def model_config(args: argparse.Namespace) -> GPTConfig:
    """The shape of every ``--model``, over the byte vocabulary of the data."""
    return GPTConfig(vocab_size=VOCAB_SIZE, seq_len=args.seq_len, d_model=args.d_model, n_heads=args.n_heads,
                     n_layers=args.n_layers)  # fmt: skip


def chosen(args: argparse.Namespace) -> tuple[list[TrainConfig], LoopSettings, RoundPlan]:
    """The configurations, loop settings and rounds the flags ask for; ValueError names a bad flag."""
    if args.grad_clip < 0:
        raise ValueError(f"--grad-clip must be >= 0 (0: off), got {args.grad_clip}")
    configs = select_configs(args.configs)
    names = tuple(config.name for config in configs)
    settings = LoopSettings(**{field.name: getattr(args, field.name) for field in dataclasses.fields(LoopSettings)})
    return configs, settings, RoundPlan(rounds=args.rounds, baseline=args.baseline or names[0], configs=names)


def join(parser: argparse.ArgumentParser, batch: int) -> DistContext:
    """Join the launch's process group; ``--batch`` must split evenly over its ranks."""
    ctx = dist_env.join(dist_env.detect())
    if batch % ctx.env.world_size:
        parser.error(f"--batch {batch} does not split evenly over {ctx.env.world_size} ranks")
    return ctx


@dataclasses.dataclass(frozen=True)
class Launch:
    """What every configuration of one launch is run with."""

    ctx: DistContext
    settings: LoopSettings
    corpus: ByteCorpus
    facts: RunFacts
    setup: EngineSetup


class StepProgress:
    """Rank 0's progress line of one configuration's run, ``StepProgress(name, steps)(step)`` after each
    step: the step reached, the seconds since the configuration started (construction included) and
    the time left at the pace of the steps after the first. On a terminal the line is rewritten in
    place; in a log it is printed at the first step, at each quarter of the run and at the last step."""

    def __init__(self, name: str, steps: int, *, stream: TextIO | None = None, clock=time.perf_counter) -> None:
        self.name, self.steps, self.stream, self.clock = name, steps, stream or sys.stderr, clock
        self.started, self.first_step_at, self.quarter = clock(), 0.0, -1
        self.in_place = bool(getattr(self.stream, "isatty", lambda: False)())

    def __call__(self, step: int) -> None:
        now, quarter = self.clock(), 4 * step // self.steps
        if step == 1:
            self.first_step_at = now  # construction and the first step's one-off costs stay out of the pace
        elif not self.in_place and step != self.steps and quarter == self.quarter:
            return
        self.quarter = quarter
        left = "estimating" if step == 1 else f"~{(now - self.first_step_at) / (step - 1) * (self.steps - step):.0f} s left"
        text = f"[bench.train] {self.name}: step {step} of {self.steps}, {now - self.started:.1f} s so far, {left}"
        self.stream.write(f"\r{text}\033[K" + ("\n" if step == self.steps else "") if self.in_place else text + "\n")
        self.stream.flush()


def run_once(launch: Launch, config: TrainConfig, model: str, spec: ModelSpec, label: str) -> ConfigResult:
    """One configuration trained once from the seed: its row, "ok" or why not (collective)."""
    settings = launch.facts.engine_configs[config.name]
    make = lambda: RUNNERS[config.engine](config, spec, settings, launch.setup)  # noqa: E731
    progress = StepProgress(label, launch.settings.steps) if launch.ctx.env.rank == 0 else None
    try:
        row = run_config(config.name, model, make, launch.corpus, launch.ctx, launch.settings, on_step=progress)
    except Unavailable as note:
        row = ConfigResult(config=config.name, model=model, status="skipped", note=str(note))
    except EngineFailed as note:
        row = failed_row(config, model, note, launch.ctx.device)
    if progress is not None and row.status != "ok":
        print(f"[bench.train] {label}: {row.status} (see the table)", file=sys.stderr, flush=True)
    return row


def run_rounds(launch: Launch, models: list[str], shape: GPTConfig, configs: list[TrainConfig],
               plan: RoundPlan) -> tuple[list[ConfigResult], dict[str, int | None]]:  # fmt: skip
    """Every configuration on every model, ``plan.rounds`` times in alternating order (see
    [Note: round order]); returns one row per (model, configuration), in the order asked
    for, and each model's parameter count.

    A configuration that does not finish a round ("skipped", "failed", "expected failure")
    is not run again: its row is that round's, its note naming the round when it was not the first.
    """
    specs: dict[str, ModelSpec] = {}
    stopped: dict[tuple[str, str], ConfigResult] = {}  # the row of the round a configuration did not finish
    for model in models:
        try:
            specs[model] = model_spec(model, shape)
        except Unavailable as note:
            stopped.update({(model, config.name): ConfigResult(config=config.name, model=model, status="skipped",
                                                               note=str(note)) for config in configs})  # fmt: skip
    units = [(model, config) for model in models for config in configs]
    firsts: dict[tuple[str, str], ConfigResult] = {}  # each configuration's row of round 1
    records: dict[tuple[str, str], list[dict]] = {(model, config.name): [] for model, config in units}
    for index in range(plan.rounds):
        running = [(model, config) for model, config in plan.order(units, index) if (model, config.name) not in stopped]
        for position, (model, config) in enumerate(running):
            label = f"{model}: {config.name}" + (f" (round {index + 1} of {plan.rounds})" if plan.rounds > 1 else "")
            row, key = run_once(launch, config, model, specs[model], label), (model, config.name)
            if row.status == "ok":
                firsts.setdefault(key, row)
                records[key].append(round_record(row, round=index + 1, position=position))
                continue
            row.note = f"round {index + 1} of {plan.rounds}: {row.note}" if index else row.note
            row.rounds = records[key]  # the rounds it finished stay in the JSON
            stopped[key] = row
    tokens_per_step = launch.settings.batch * launch.settings.seq_len
    table = [stopped.get(key) or combine(firsts[key], records[key], tokens_per_step=tokens_per_step,
                                         link_bytes_per_s=launch.facts.link_bytes_per_s) for key in records]
    attach_ratios(table, plan.baseline)
    return table, {m: sum(p.numel() for p in specs[m].build().parameters()) if m in specs else None for m in models}


def _deepspeed_version() -> str | None:
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version("deepspeed")
    return None


def failed_row(config: TrainConfig, model: str, failure: EngineFailed, device: torch.device) -> ConfigResult:
    """A configuration whose engine raised: "expected failure" with the known reason and the
    error's first line when the configuration is known to fail on this device, else "failed"
    with the whole description (where the engine raised it)."""
    if config.fails_on_cpu and device.type == "cpu":
        cause = failure.__cause__ or failure
        said = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
        return ConfigResult(config=config.name, model=model, status="expected failure",
                            note=f"{config.fails_on_cpu} (it raised {said})")
    return ConfigResult(config=config.name, model=model, status="failed", note=str(failure))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        (configs, settings, plan), shape = chosen(args), model_config(args)
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    ctx = join(parser, args.batch)
    env = ctx.env
    precision = agreed_precision(args.dtype, ctx.device)
    if env.rank == 0:
        print(f"[bench.train] precision: {precision.dtype} ({precision.reason}); measuring the inter-node link",
              file=sys.stderr, flush=True)  # fmt: skip
    setup = EngineSetup(lr=args.lr, local_size=env.local_size, world_size=env.world_size, bf16=precision.dtype == "bf16",
                        gradient_clipping=args.grad_clip, micro_batch=args.batch // env.world_size, device=ctx.device)
    engine_configs = {config.name: engine_config(config, setup) for config in configs}
    facts = RunFacts(cpu=cpu_model(read_cpuinfo()), device=str(ctx.device), precision=precision,
                     link_bytes_per_s=measure_link_throughput(ctx), deepspeed=_deepspeed_version(),
                     engine_configs=engine_configs)  # fmt: skip
    corpus = ByteCorpus(args.seq_len)
    rows, params = run_rounds(Launch(ctx, settings, corpus, facts, setup), args.model, shape, configs, plan)
    if env.rank == 0:
        report(rows, params, corpus, env, args, facts, plan)
    dist.destroy_process_group()
    return 0
