"""A model that does not fit: killed for lack of memory without offload, trained with NVMe offload.

Run as root: ``python -m bench.offload_oom --nvme-path DIR --limit 5G`` (``--help``). Each job
trains a Hugging Face GPT-2 (default: GPT-2 medium, 355M parameters, fp32, built under
``zero_runtime.Init``) with stage 3 on ``--world-size`` gloo ranks, in a fresh cgroup-v1 memory
cgroup capping all its ranks: ``none`` (states in memory), ``nvme`` (``offload_optimizer``),
``nvme-param`` (ZeRO-Infinity: parameters on NVMe too, each unit freed after every use),
``nvme-param-overlap`` (with ``zcomm_overlap_step``: each unit updated during backward). Unless
``--no-baseline``, ``none`` also runs uncapped: its step is the compute time without I/O.

A job is killed when the OOM killer ended one of its ranks; its peak is the cgroup's
``memory.max_usage_in_bytes`` (uncapped: the sum of the ranks' ``VmHWM``). ``dd`` measures the
disk before each round, so the target, a step within 1.25x of max(compute, I/O), uses that
round's rates (a shared disk's speed drifts); ``--repeats N`` runs N rounds in alternating order
and compares the overlapped step with the plain one per round. The jobs run with glibc's
``mmap`` threshold fixed ([Note: glibc's mmap threshold] in ``bench.harness.ranks``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median_high

import torch

from bench.harness.flags import parse_size
from bench.harness.ranks import MALLOC_ENV, spawn, status_bytes
from bench.harness.table import markdown
from bench.nvme_swap import dd_rates

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
SUB_GROUP_SIZE = 5_000_000
PARAM_BUFFERS = 3  # offload_param.buffer_count of the nvme-param jobs (each holds the largest shard)
PARAM_MODE_MAX_LIVE = 100_000_000  # stage3_max_live_parameters of the nvme-param jobs
MODES = ("none", "nvme", "nvme-param", "nvme-param-overlap")
TIMEOUT_S = 3600  # of a job
_TIMINGS = ("total_s", "forward_backward_s", "step_s")
# the model's shape and the offload settings, passed on to the job's process
_SHAPE = ("world_size", "steps", "n_embd", "n_layer", "n_head", "seq_len", "aio_queue_depth", "nvme_path")


def _config(mode: str, args: argparse.Namespace) -> dict:
    zero = {"stage": 3}
    if mode != "none":
        zero.update(offload_optimizer={"device": "nvme", "nvme_path": args.nvme_path, "buffer_count": 4,
                                       "zcomm_overlap_step": mode == "nvme-param-overlap"},
                    sub_group_size=SUB_GROUP_SIZE)
    if mode.startswith("nvme-param"):  # ZeRO-Infinity: shards on NVMe too, and units freed after each use
        zero.update(offload_param={"device": "nvme", "nvme_path": args.nvme_path, "buffer_count": PARAM_BUFFERS},
                    stage3_max_reuse_distance=0, stage3_max_live_parameters=PARAM_MODE_MAX_LIVE)
    return {"zero_optimization": zero, "aio": {"queue_depth": args.aio_queue_depth}}


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    """This rank's training: its parameter count, step times and I/O counters."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import zero_runtime

    config = _config(args.worker, args)
    torch.manual_seed(0)
    with zero_runtime.Init(config):
        model = GPT2LMHeadModel(GPT2Config(n_embd=args.n_embd, n_layer=args.n_layer, n_head=args.n_head,
                                           n_positions=args.seq_len, vocab_size=50257))
    params = sum(p.numel() for p in dict.fromkeys(model.parameters()))
    model, opt = zero_runtime.initialize(model, functools.partial(torch.optim.AdamW, lr=1e-4), config)
    tokens = torch.Generator().manual_seed(rank)
    steps = []
    for _ in range(args.steps):
        batch = torch.randint(0, 50257, (1, args.seq_len), generator=tokens)
        start = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        opt.backward(loss)
        backward = time.perf_counter()
        opt.step()
        end = time.perf_counter()
        steps.append({"forward_backward_s": backward - start, "step_s": end - backward, "total_s": end - start})
    report = opt.memory_report()
    swap = opt.param_offload
    opt.close()  # the swap files go before the rank leaves without finalization
    return {"params": params, "steps": steps, "peak_rss": status_bytes("VmHWM"),
            "offloaded_bytes": report.offloaded_optimizer_states, "offloaded_param_bytes": report.offloaded_parameters,
            "param_read_bytes": swap.bytes_read if swap else 0, "param_written_bytes": swap.bytes_written if swap else 0}


def _worker(args: argparse.Namespace) -> int:
    """The job: ``--world-size`` ranks, their results in ``--json``; a failed rank ends the others."""
    try:
        ranks = spawn(_rank, args.world_size, args, timeout=TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - the job failed; the parent reports its stderr
        print(f"bench.offload_oom: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    Path(args.json).write_text(json.dumps(ranks))
    return 0


def _run_job(mode: str, args: argparse.Namespace, limit: int | None, scratch: Path) -> dict:
    """One job in its own process, in a fresh cgroup capped at ``limit`` (None: no cgroup); its
    ``medians`` per timing over every rank's steps after the first (None: not completed)."""
    out = scratch / f"result-{mode}-{'capped' if limit else 'free'}.json"
    command = [sys.executable, "-m", "bench.offload_oom", "--worker", mode, "--json", str(out),
               *(f"--{key.replace('_', '-')}={getattr(args, key)}" for key in _SHAPE)]
    group = CGROUP_ROOT / f"zcomm_offload_oom_{os.getpid()}_{mode}" if limit is not None else None
    if group is not None:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(limit))
    try:
        preexec = (lambda: (group / "cgroup.procs").write_text(str(os.getpid()))) if group else None
        proc = subprocess.run(command, preexec_fn=preexec, env={**os.environ, **MALLOC_ENV}, capture_output=True,
                              text=True, timeout=TIMEOUT_S)
        ranks = json.loads(out.read_text()) if out.exists() else []
        later = [step for rank in ranks for step in rank["steps"][1:]]
        done = proc.returncode == 0 and len(ranks) == args.world_size
        result = {"mode": mode, "limit": limit, "exit": proc.returncode, "ranks": ranks, "stderr_tail": proc.stderr[-1500:],
                  "peak": sum(r["peak_rss"] for r in ranks), "oom_kills": 0, "completed": done,
                  "medians": {key: median_high([step[key] for step in later]) for key in _TIMINGS} if done and later else None}
        if group is not None:
            oom = dict(line.split() for line in (group / "memory.oom_control").read_text().splitlines())
            result.update(peak=int((group / "memory.max_usage_in_bytes").read_text()),
                          oom_kills=int(oom.get("oom_kill", 0)))
        return result
    finally:
        if group is not None:
            _empty_and_remove(group)


def _empty_and_remove(group: Path) -> None:
    for _ in range(50):
        pids = [int(p) for p in (group / "cgroup.procs").read_text().split()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)
    group.rmdir()


def _report(results: list[dict], args: argparse.Namespace, disks: list[dict[str, float]]) -> None:
    gib = 2**30
    params = next((r["ranks"][0]["params"] for r in results if r["ranks"]), 0)
    malloc = " ".join(f"{key}={value}" for key, value in MALLOC_ENV.items())
    print(f"# Training a model that does not fit: HF GPT-2 {params / 1e6:.0f}M parameters, fp32, stage 3, "
          f"{args.world_size} gloo ranks, one thread each\n")
    print(f"shape: n_embd {args.n_embd}, n_layer {args.n_layer}, seq_len {args.seq_len}, batch 1 per rank; "
          f"{args.steps} steps (the first is excluded from step times); sub_group_size {SUB_GROUP_SIZE}; "
          f"offload_param.buffer_count {PARAM_BUFFERS}; aio.queue_depth {args.aio_queue_depth}; "
          f"nvme_path {args.nvme_path}; torch {torch.__version__}; {malloc}\n")
    for repeat, disk in enumerate(disks):
        print(f"disk before run {repeat} (dd, 1 GiB, direct I/O): write {disk['write']:.2f} GB/s, "
              f"read {disk['read']:.2f} GB/s\n")
    rows = []
    for r in results:
        outcome = "completed" if r["completed"] else (f"killed by the OOM killer ({r['oom_kills']} kill(s))"
                                                    if r["oom_kills"] else f"failed (exit {r['exit']})")
        rows.append({"run": "-" if r["repeat"] is None else r["repeat"], "job": r["mode"],
                     "memory limit": f"{r['limit'] / gib:.1f} GiB" if r["limit"] else "none", "outcome": outcome,
                     "peak memory (all ranks)": f"{r['peak'] / gib:.2f} GiB",
                     **{heading: f"{r['medians'][key]:.1f}" if r["medians"] else "-" for heading, key in zip(
                         ("step s (median)", "forward+backward s", "step() s"), _TIMINGS, strict=True)}})  # fmt: skip
    print("\n".join(markdown(rows)))
    for r in results:
        if r["exit"] and not r["oom_kills"]:
            print(f"\n{r['mode']} (limit {r['limit']}) failed:\n```\n{r['stderr_tail']}\n```")
    _target(results, args, disks)


def _step(results: list[dict], mode: str, repeat: int | None) -> float | None:
    """The median step of ``mode``'s job in run ``repeat`` (None: the unlimited baseline), if it completed."""
    job = next((r for r in results if (r["mode"], r["repeat"]) == (mode, repeat) and r["medians"]), None)
    return job["medians"]["total_s"] if job else None


def _target(results: list[dict], args: argparse.Namespace, disks: list[dict[str, float]]) -> None:
    """Per capped job, its median step against max(compute, I/O), the I/O at the rates ``dd``
    measured just before that run; then the median over the runs of each mode."""
    compute = _step(results, "none", None)
    for mode in (m for m in MODES[1:] if m in args.modes):
        jobs = [r for r in results if r["mode"] == mode and r["repeat"] is not None and r["medians"]]
        if compute is None or not jobs:
            print(f"\ntarget for {mode} (step <= 1.25x max(compute, I/O)): not evaluated (needs the {mode} job "
                  "and the baseline)")
            continue
        ratio = median_high([_versus_io(job, compute, disks[job["repeat"]], args) for job in jobs])
        print(f"\ntarget for {mode}: NVMe step <= 1.25x max(compute, I/O): median over "
              f"{len(jobs)} run(s) {ratio:.2f}x: {'PASS' if ratio <= 1.25 else 'MISS'}")
    pairs = [(_step(results, "nvme-param-overlap", k), _step(results, "nvme-param", k)) for k in range(args.repeats)]
    ratios = [a / b for a, b in pairs if a and b]
    if ratios:
        print(f"\nnvme-param-overlap / nvme-param step time, per run: {', '.join(f'{x:.2f}' for x in ratios)} "
              f"(median {median_high(ratios):.2f})")


def _versus_io(job: dict, compute: float, disk: dict[str, float], args: argparse.Namespace) -> float:
    """The job's median step over max(compute, I/O), printed with its parts. I/O per step, all ranks: the
    optimizer's swap file once each way, and the parameter shards as counted by the run (less their first
    write at start-up), at ``disk``'s rates."""
    states = sum(rank["offloaded_bytes"] for rank in job["ranks"])
    read = states + sum(rank["param_read_bytes"] for rank in job["ranks"]) / args.steps
    written = states + sum(rank["param_written_bytes"] - rank["offloaded_param_bytes"] for rank in job["ranks"]) / args.steps
    io = read / (disk["read"] * 1e9) + written / (disk["write"] * 1e9)
    measured = job["medians"]["total_s"]
    print(f"\nrun {job['repeat']}, {job['mode']}: compute = the unlimited `none` step {compute:.1f} s; I/O = "
          f"{read / 1e9:.2f} GB read and {written / 1e9:.2f} GB written per step (all ranks) at that run's "
          f"dd rates = {io:.1f} s; measured {measured:.1f} s = {measured / max(compute, io):.2f}x")
    return measured / max(compute, io)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nvme-path", required=True, help="directory for the swap files (and dd's probe)")
    parser.add_argument("--limit", type=parse_size, default=parse_size("5G"), help="memory cap of each capped job")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--n-embd", type=int, default=1024)
    parser.add_argument("--n-layer", type=int, default=24)
    parser.add_argument("--n-head", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="the jobs run under the memory limit (default: all)")
    parser.add_argument("--aio-queue-depth", type=int, default=8,
                        help="aio.queue_depth: requests in flight per swap file (default 8, DeepSpeed's)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of the capped jobs, in alternating order, each after its own dd probe")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unlimited `none` job")
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> None:
    cli = build_parser()
    args = cli.parse_args(argv)
    if args.worker:
        sys.exit(_worker(args))
    if os.geteuid() != 0 or not CGROUP_ROOT.is_dir():
        cli.error(f"needs root and the cgroup-v1 memory controller at {CGROUP_ROOT}")
    os.makedirs(args.nvme_path, exist_ok=True)
    disks, results = [], []
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):  # alternating order, so drift in the disk's speed hits both sides
            disks.append(dd_rates(args.nvme_path, 1024))
            for mode in (args.modes if repeat % 2 == 0 else reversed(args.modes)):
                results.append({**_run_job(mode, args, args.limit, Path(scratch)), "repeat": repeat})
        if not args.no_baseline:
            results.append({**_run_job("none", args, None, Path(scratch)), "repeat": None})
    _report(results, args, disks)


if __name__ == "__main__":
    main()
