"""A model that does not fit: killed for lack of memory without offload, trained with NVMe offload.

Run as root: ``python -m bench.offload_oom --nvme-path DIR --limit 5G`` (``--help``). Each
mode trains the same Hugging Face GPT-2 (default: GPT-2 medium's shape, 355M parameters,
fp32, built under ``zero_runtime.Init`` so that construction never holds the whole model)
with stage 3 on ``--world-size`` gloo ranks for ``--steps`` steps, in a fresh cgroup-v1
memory cgroup whose limit (``--limit``) covers the whole job, all ranks together:

* ``none``: model states in memory;
* ``nvme``: ``offload_optimizer: nvme`` (masters and Adam states in one swap file per rank
  under ``--nvme-path``, read and written in sub-groups by the step's pipeline);
* ``nvme-param``: ZeRO-Infinity's setting, ``offload_optimizer`` and ``offload_param`` both on
  NVMe, with each unit freed after every use (``stage3_max_reuse_distance: 0``, at most
  ``PARAM_MODE_MAX_LIVE`` live elements) so that neither shards nor gathered weights stay
  resident beyond the units in use and the reads ahead;
* ``nvme-param-overlap``: ``nvme-param`` with ``offload_optimizer.zcomm_overlap_step``, which
  updates each unit during backward as soon as its gradient is reduced, so the optimizer's
  swap traffic overlaps backward instead of following it;
* ``none, no limit`` (unless ``--no-baseline``): the ``none`` job outside any cgroup, for its
  peak resident memory and its step time, which is the compute time of the same math
  without I/O.

A job is reported as killed when the kernel's OOM killer ended one of its ranks (the
cgroup's ``memory.oom_control`` counter) and as completed when every rank finished; the
peak is the cgroup's ``memory.max_usage_in_bytes`` (for the unlimited baseline: the sum of
the ranks' ``VmHWM``). ``dd`` with direct I/O measures the disk's sequential bandwidth in the
same run, so the I/O time of a step (every rank's masters and states read and written once)
is stated next to the measured step time: the target is a step within 1.25x of
max(compute, I/O). With ``--repeats N`` the capped jobs run N times in alternating order,
each round after its own ``dd`` probe (a shared disk's speed drifts), and the overlapped
step is compared with the plain one round by round. Gradient shards stay in memory in every mode. Cgroups and swap files are
removed at the end.

Every job runs with glibc's ``mmap`` threshold fixed (``MALLOC_ENV``; [Note: glibc's mmap
threshold] in ``bench.harness.process_memory``): with glibc's default, GPT-2 medium's freed shards
stayed resident and offload saved almost nothing of the resident set.
"""

from __future__ import annotations

import argparse
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
from bench.harness.process_memory import MALLOC_ENV, status_bytes
from bench.harness.ranks import spawn
from bench.nvme_swap import dd_rate

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
PARAM_MODE_MAX_LIVE = 100_000_000  # stage3_max_live_parameters of the nvme-param job


MODES = ("none", "nvme", "nvme-param", "nvme-param-overlap")
_OFFLOADED = MODES[1:]
_PARAM_OFFLOADED = MODES[2:]


def _config(mode: str, nvme_path: str, sub_group_size: int, param_buffers: int, queue_depth: int) -> dict:
    zero = {"stage": 3}
    if mode in _OFFLOADED:
        zero.update(offload_optimizer={"device": "nvme", "nvme_path": nvme_path, "buffer_count": 4,
                                       "zcomm_overlap_step": mode == "nvme-param-overlap"},
                    sub_group_size=sub_group_size)
    if mode in _PARAM_OFFLOADED:  # ZeRO-Infinity: shards on NVMe too, and units freed after each use
        zero.update(offload_param={"device": "nvme", "nvme_path": nvme_path, "buffer_count": param_buffers},
                    stage3_max_reuse_distance=0, stage3_max_live_parameters=PARAM_MODE_MAX_LIVE)
    return {"zero_optimization": zero, "aio": {"queue_depth": queue_depth}}


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> dict:
    """This rank's training: its parameter count, step times and I/O counters."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import zero_runtime

    config = _config(args.worker, args.nvme_path, args.sub_group_size, args.param_buffers, args.aio_queue_depth)
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
        steps.append({"forward_backward_s": backward - start, "step_s": end - backward, "total_s": end - start,
                      "loss": loss.item()})
    report = opt.memory_report()
    swap = opt.param_offload
    opt.close()  # the swap files go before the rank leaves without finalization
    return {"params": params, "steps": steps, "peak_rss": status_bytes("VmHWM"),
            "offloaded_bytes": report.offloaded_optimizer_states, "offloaded_param_bytes": report.offloaded_parameters,
            "param_read_bytes": swap.bytes_read if swap else 0, "param_written_bytes": swap.bytes_written if swap else 0}


def _worker(args: argparse.Namespace) -> int:
    """The job: ``--world-size`` ranks, their results in ``--json``; a failed rank ends the others."""
    try:
        ranks = spawn(_rank, args.world_size, args, timeout=args.timeout)
    except Exception as exc:  # noqa: BLE001 - the job failed; the parent reports its stderr
        print(f"bench.offload_oom: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    Path(args.json).write_text(json.dumps(ranks))
    return 0


def _cgroup_value(group: Path, name: str) -> int:
    return int((group / name).read_text().split()[0])


def _oom_kills(group: Path) -> int:
    fields = dict(line.split() for line in (group / "memory.oom_control").read_text().splitlines())
    return int(fields.get("oom_kill", 0))


def _run_job(mode: str, args: argparse.Namespace, limit: int | None, scratch: Path) -> dict:
    out = str(scratch / f"result-{mode}-{'capped' if limit else 'free'}.json")
    command = [sys.executable, "-m", "bench.offload_oom", "--worker", mode, "--json", out,
               *(f"--{k.replace('_', '-')}={v}" for k, v in _shape(args).items())]
    group = None
    if limit is not None:
        group = CGROUP_ROOT / f"zcomm_offload_oom_{os.getpid()}_{mode}"
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(limit))
    try:
        start = time.perf_counter()
        preexec = (lambda: (group / "cgroup.procs").write_text(str(os.getpid()))) if group else None
        env = {**os.environ, **MALLOC_ENV}
        proc = subprocess.run(command, preexec_fn=preexec, env=env, capture_output=True, text=True,
                              timeout=args.timeout)
        wall = time.perf_counter() - start
        ranks = json.loads(Path(out).read_text()) if Path(out).exists() else []
        result = {"mode": mode, "limit": limit, "exit": proc.returncode, "wall_s": wall, "ranks": ranks,
                  "stderr_tail": proc.stderr[-1500:]}
        if group is not None:
            result.update(peak=_cgroup_value(group, "memory.max_usage_in_bytes"), oom_kills=_oom_kills(group))
        else:
            result.update(peak=sum(r["peak_rss"] for r in ranks), oom_kills=0)
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
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    group.rmdir()


def _shape(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in ("world_size", "steps", "n_embd", "n_layer", "n_head", "seq_len",
                                          "sub_group_size", "param_buffers", "aio_queue_depth", "nvme_path")}


_TIMINGS = ("total_s", "forward_backward_s", "step_s")


def _completed(job: dict, args: argparse.Namespace) -> bool:
    return job["exit"] == 0 and len(job["ranks"]) == args.world_size


def _medians(job: dict) -> dict[str, float] | None:
    """Per timing, the median over every rank's steps after the first (None with one step)."""
    later = [step for rank in job["ranks"] for step in rank["steps"][1:]]
    return {key: median_high([step[key] for step in later]) for key in _TIMINGS} if later else None


def _report(results: list[dict], args: argparse.Namespace, disks: list[dict[str, float]]) -> None:
    gib = 2**30
    params = next((r["ranks"][0]["params"] for r in results if r["ranks"]), 0)
    malloc = " ".join(f"{key}={value}" for key, value in MALLOC_ENV.items())
    print(f"# Training a model that does not fit: HF GPT-2 {params / 1e6:.0f}M parameters, fp32, stage 3, "
          f"{args.world_size} gloo ranks, one thread each\n")
    print(f"shape: n_embd {args.n_embd}, n_layer {args.n_layer}, seq_len {args.seq_len}, batch 1 per rank; "
          f"{args.steps} steps (the first is excluded from step times); sub_group_size {args.sub_group_size}; "
          f"offload_param.buffer_count {args.param_buffers}; aio.queue_depth {args.aio_queue_depth}; "
          f"nvme_path {args.nvme_path}; torch {torch.__version__}; {malloc}\n")
    for repeat, disk in enumerate(disks):
        print(f"disk before run {repeat} (dd, 1 GiB, direct I/O): write {disk['write']:.2f} GB/s, "
              f"read {disk['read']:.2f} GB/s\n")
    print("| run | job | memory limit | outcome | peak memory (all ranks) | step s (median) | forward+backward s "
          "| step() s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        done = _completed(r, args)
        outcome = "completed" if done else (f"killed by the OOM killer ({r['oom_kills']} kill(s))" if r["oom_kills"]
                                            else f"failed (exit {r['exit']})")
        limit = f"{r['limit'] / gib:.1f} GiB" if r["limit"] else "none"
        medians = _medians(r) if done else None
        cells = [f"{medians[key]:.1f}" for key in _TIMINGS] if medians else ["-"] * len(_TIMINGS)
        run = "-" if r["repeat"] is None else r["repeat"]
        print(f"| {run} | {r['mode']} | {limit} | {outcome} | {r['peak'] / gib:.2f} GiB | " + " | ".join(cells) + " |")
    for r in results:
        if r["exit"] and not r["oom_kills"]:
            print(f"\n{r['mode']} (limit {r['limit']}) failed:\n```\n{r['stderr_tail']}\n```")
    _target(results, args, disks)


def _target(results: list[dict], args: argparse.Namespace, disks: list[dict[str, float]]) -> None:
    """Per capped job, its median step against max(compute, I/O), the I/O at the rates ``dd``
    measured just before that run; then the median over the runs of each mode."""
    baseline = next((r for r in results if r["repeat"] is None and _completed(r, args)), None)
    compute = _medians(baseline)["total_s"] if baseline and _medians(baseline) else None
    for mode in (m for m in _OFFLOADED if m in args.modes):
        jobs = [r for r in results if r["mode"] == mode and r["repeat"] is not None and _completed(r, args)]
        if compute is None or not jobs or _medians(jobs[0]) is None:
            print(f"\ntarget for {mode} (step <= 1.25x max(compute, I/O)): not evaluated (needs the {mode} job "
                  "and the baseline)")
            continue
        ratios = []
        for job in jobs:
            read, written = _io_per_step(job, args)
            disk = disks[job["repeat"]]
            io = read / (disk["read"] * 1e9) + written / (disk["write"] * 1e9)
            measured = _medians(job)["total_s"]
            ratios.append(measured / max(compute, io))
            print(f"\nrun {job['repeat']}, {mode}: compute = the unlimited `none` step {compute:.1f} s; I/O = "
                  f"{read / 1e9:.2f} GB read and {written / 1e9:.2f} GB written per step (all ranks) at that run's "
                  f"dd rates = {io:.1f} s; measured {measured:.1f} s = {ratios[-1]:.2f}x")
        ratio = median_high(ratios)
        print(f"\ntarget for {mode}: NVMe step <= 1.25x max(compute, I/O): median over "
              f"{len(ratios)} run(s) {ratio:.2f}x: {'PASS' if ratio <= 1.25 else 'MISS'}")
    _paired(results, args)


def _paired(results: list[dict], args: argparse.Namespace) -> None:
    """The overlapped step against the plain one, run by run (both in the same repeat)."""
    def step(mode: str, repeat: int) -> float | None:
        job = next((r for r in results if r["mode"] == mode and r["repeat"] == repeat and _completed(r, args)), None)
        return _medians(job)["total_s"] if job and _medians(job) else None

    pairs = [(step("nvme-param-overlap", k), step("nvme-param", k)) for k in range(args.repeats)]
    ratios = [a / b for a, b in pairs if a and b]
    if ratios:
        print(f"\nnvme-param-overlap / nvme-param step time, per run: {', '.join(f'{x:.2f}' for x in ratios)} "
              f"(median {median_high(ratios):.2f})")


def _io_per_step(job: dict, args: argparse.Namespace) -> tuple[float, float]:
    """Bytes read and written per step, all ranks: the optimizer's swap file once each way,
    and the parameter shards as counted by the run (less their first write at start-up)."""
    states = sum(rank["offloaded_bytes"] for rank in job["ranks"])
    read = sum(rank["param_read_bytes"] for rank in job["ranks"]) / args.steps
    written = sum(rank["param_written_bytes"] - rank["offloaded_param_bytes"] for rank in job["ranks"]) / args.steps
    return states + read, states + written


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nvme-path", required=True, help="directory for the swap files (and dd's probe)")
    parser.add_argument("--limit", type=parse_size, default=parse_size("5G"), help="memory cap of each capped job")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--n-embd", type=int, default=1024)
    parser.add_argument("--n-layer", type=int, default=24)
    parser.add_argument("--n-head", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--sub-group-size", type=int, default=5_000_000)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="the jobs run under the memory limit (default: all)")
    parser.add_argument("--param-buffers", type=int, default=3,
                        help="offload_param.buffer_count of the nvme-param jobs (each holds the largest shard)")
    parser.add_argument("--aio-queue-depth", type=int, default=8,
                        help="aio.queue_depth: requests in flight per swap file (default 8, DeepSpeed's)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of the capped jobs, in alternating order, each after its own dd probe")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unlimited `none` job")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return _parser().parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.worker:
        sys.exit(_worker(args))
    if os.geteuid() != 0 or not CGROUP_ROOT.is_dir():
        parser.error(f"needs root and the cgroup-v1 memory controller at {CGROUP_ROOT}")
    os.makedirs(args.nvme_path, exist_ok=True)
    disks, results = [], []
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):  # alternating order, so drift in the disk's speed hits both sides
            disks.append(_disk(args.nvme_path))
            for mode in (args.modes if repeat % 2 == 0 else reversed(args.modes)):
                results.append({**_run_job(mode, args, args.limit, Path(scratch)), "repeat": repeat})
        if not args.no_baseline:
            results.append({**_run_job("none", args, None, Path(scratch)), "repeat": None})
    _report(results, args, disks)


def _disk(nvme_path: str) -> dict[str, float]:
    """The disk's sequential write and read bandwidth (GB/s) with direct I/O, by ``dd``."""
    probe = Path(nvme_path) / f"dd_probe_{os.getpid()}"
    try:
        return {"write": dd_rate(["if=/dev/zero", f"of={probe}", "bs=1M", "count=1024", "oflag=direct",
                                  "conv=fsync"]),
                "read": dd_rate([f"if={probe}", "of=/dev/null", "bs=1M", "iflag=direct"])}
    finally:
        probe.unlink(missing_ok=True)

if __name__ == "__main__":
    main()
