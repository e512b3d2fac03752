"""The training engines of ``python -m bench.train`` behind one interface: zero_runtime, FSDP2, DDP, DeepSpeed.

A runner owns one model and its optimizer (torch's AdamW, [Note: same math] in :mod:`.configs`)
under one engine. The loop only calls ``train_step`` (forward, backward, optimizer step, zero
grad; returns this rank's loss), ``eval_loss``, ``memory`` and ``close``, so the loop, the timing
and the wire bytes are the same code for every configuration. Peak memory on a CPU, where torch
keeps no allocator statistics, is the model-state bytes held after the optimizer step (the ZeRO
paper's accounting, without activations; none for DeepSpeed: no torch counter sees its partitions).
"""

from __future__ import annotations

import contextlib
import functools
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import zcomm
import zcomm.ddp
import zcomm.fsdp
import zero_runtime

from .configs import EngineSetup, TrainConfig
from .models import ModelSpec, Unavailable


class EngineFailed(RuntimeError):
    """A peer engine raised while setting up or training: its row shows the error. Only for errors every
    rank meets at the same point (e.g. a kernel with no CPU build), so that all ranks leave the
    configuration together and the next one starts on a consistent process group."""


def model_state_nbytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's parameters, gradients and optimizer states (a DTensor's: its shard's)."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    tensors = [*params, *(p.grad for p in params if p.grad is not None),
               *(v for p in params for v in optimizer.state.get(p, {}).values() if torch.is_tensor(v))]
    local = [tensor.to_local() if isinstance(tensor, DTensor) else tensor for tensor in tensors]
    return sum(tensor.numel() * tensor.element_size() for tensor in local)


class Runner:
    """What every engine shares: the loss through the model spec, evaluation, the memory reading."""

    HELD = ""  # what the CPU memory figure counts
    CUDA_PEAK = True  # on a GPU the figure is torch's peak allocation instead
    model: torch.nn.Module

    def __init__(self, spec: ModelSpec, setup: EngineSetup) -> None:
        self.spec, self.setup, self.device = spec, setup, setup.device
        self.peak_bytes: int | None = 0

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.spec.loss(self.model, tokens)

    @torch.no_grad()
    def eval_loss(self, tokens: torch.Tensor) -> float:
        return self.loss(tokens).item()

    def memory(self) -> tuple[int | None, str]:
        """Peak bytes on this rank (None when the engine cannot tell) and how they were measured."""
        if self.CUDA_PEAK and self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device), "torch.cuda.max_memory_allocated"
        return self.peak_bytes, self.HELD

    def close(self) -> None:
        """Nothing to release: the engine's hooks and buffers go with the model, collected with the runner."""


class ZeroRunner(Runner):
    HELD, CUDA_PEAK = "zero_runtime memory_report()", False

    def __init__(self, config: TrainConfig, spec: ModelSpec, engine_config: dict[str, Any], setup: EngineSetup) -> None:
        super().__init__(spec, setup)
        factory = functools.partial(torch.optim.AdamW, lr=setup.lr)
        topology = zcomm.Topology(world_size=setup.world_size, local_size=setup.local_size)
        self.model, self.opt = zero_runtime.initialize(spec.build().to(self.device), factory, engine_config,
                                                       topology=topology)  # fmt: skip

    def train_step(self, tokens: torch.Tensor) -> float:
        loss = self.loss(tokens)
        self.opt.backward(loss)
        self.opt.step()
        # After step, before zero_grad: gradients and updated states are both still held.
        self.peak_bytes = max(self.peak_bytes, self.opt.memory_report().total)
        self.opt.zero_grad()
        return loss.item()

    def close(self) -> None:
        """Release the engine (``ZeroOptimizer.close`` also removes its gradient hooks), so the
        engines one launch builds (configurations x ``--rounds``) do not stack up in memory."""
        self.opt.close()


class TorchRunner(Runner):
    """The step where torch's AdamW steps the wrapped model (DDP, FSDP2); clipping is torch's ``clip_grad_norm_``."""

    opt: torch.optim.Optimizer

    def train_step(self, tokens: torch.Tensor) -> float:
        loss = self.loss(tokens)
        loss.backward()
        if self.setup.gradient_clipping > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.setup.gradient_clipping)
        self.opt.step()
        if self.device.type == "cpu":
            self.peak_bytes = max(self.peak_bytes, model_state_nbytes(self.opt))
        self.opt.zero_grad()
        return loss.item()


def reshard_after_forward(config: TrainConfig, *, local_size: int, world_size: int) -> bool | int:
    """FSDP2's setting for ``config``: True (plain ZeRO-3) or the hpZ group size. FSDP2 accepts an
    int only strictly between 1 and the world size; at the ends hpZ means keeping whole weights
    (1 rank per node) or the primary sharding itself (one node)."""
    if not config.hpz or local_size == world_size:
        return True
    return local_size if local_size > 1 else False


class FSDP2Runner(TorchRunner):
    """torch ``fully_shard``: one FSDP unit per repeated block, the root holds the rest (as torchtitan
    wraps a transformer); bf16 is ``MixedPrecisionPolicy(param_dtype=bfloat16)`` over fp32 shards.

    qwZ and qgZ: ``zcomm.fsdp.enable_zeropp`` with the engine config's arguments (its return value,
    which units it aligned, kept in ``aligned``). HSDP: a 2-D mesh (replicate = nodes, shard = ranks
    per node); FSDP2's own HSDP shards on all of it, zcomm's on its ``"shard"`` rows with the
    ``"replicate"`` group passed to ``enable_zeropp``.
    """

    HELD = "model states held (params+grads+AdamW, local shards)"

    def __init__(self, config: TrainConfig, spec: ModelSpec, engine_config: dict[str, Any], setup: EngineSetup) -> None:
        super().__init__(spec, setup)
        world, local = setup.world_size, setup.local_size
        zeropp = "enable_zeropp" in engine_config
        options = {key: value for key, value in engine_config.get("enable_zeropp", {}).items() if value is not None}
        if config.hsdp:
            hybrid = init_device_mesh(self.device.type, (world // local, local), mesh_dim_names=("replicate", "shard"))
            mesh = hybrid["shard"] if zeropp else hybrid
            options.update(topology=zcomm.Topology(world_size=local, local_size=local),
                           replicate_group=hybrid.get_group("replicate"),
                           replicate_topology=zcomm.Topology(world_size=world // local, local_size=1))  # fmt: skip
        else:
            mesh = init_device_mesh(self.device.type, (world,))
            options.update(topology=zcomm.Topology(world_size=world, local_size=local))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if setup.bf16 else MixedPrecisionPolicy()
        reshard = reshard_after_forward(config, local_size=local, world_size=world)
        self.model = spec.build().to(self.device)
        for module in [*spec.blocks(self.model), self.model]:
            fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        self.aligned = zcomm.fsdp.enable_zeropp(self.model, **options) if zeropp else {}
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=setup.lr)


def bf16_hook(process_group, bucket):  # unannotated: DDP refuses annotations that are strings
    """torch's ``bf16_compress_hook`` algorithm (cast to bf16, divide by the group size, all-reduce,
    cast back into the bucket), for CPU runs: DDP refuses torch's own hook by its name there
    ("requires CUDA 11+ and NCCL 2.10+")."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(group.size())
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()
    return future.then(lambda done: buffer.copy_(done.value()[0]))


class DDPRunner(TorchRunner):
    """torch ``DistributedDataParallel`` (stage 0): DDP's fp32 all-reduce, torch's ``bf16_compress_hook``
    (:func:`bf16_hook` on a CPU) or ``zcomm.ddp.quantized_allreduce_hook``. bf16 is ``torch.autocast``
    around forward with fp32 weights and gradients, so every DDP row reduces fp32 buckets. The hook is
    the engine config's; the loss calls the DDP module, whose forward prepares its reducer for backward."""

    HELD = "model states held (params+grads+AdamW, whole model)"

    def __init__(self, config: TrainConfig, spec: ModelSpec, engine_config: dict[str, Any], setup: EngineSetup) -> None:
        super().__init__(spec, setup)
        self.model = DistributedDataParallel(spec.build().to(self.device),
                                             device_ids=[self.device] if self.device.type == "cuda" else None)
        if engine_config["ddp_hook"] == "bf16":
            self.model.register_comm_hook(None, default_hooks.bf16_compress_hook if self.device.type == "cuda"
                                          else bf16_hook)  # fmt: skip
        elif engine_config["ddp_hook"] == "zcomm":
            widths = {key: engine_config[key] for key in ("first_hop_bits", "gather_bits") if engine_config[key] is not None}
            topology = zcomm.Topology(world_size=setup.world_size, local_size=setup.local_size)
            state = zcomm.ddp.QuantizedAllReduceState(topology=topology, **widths)
            self.model.register_comm_hook(state, zcomm.ddp.quantized_allreduce_hook)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=setup.lr)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.setup.bf16):
            return self.spec.loss(self.model, tokens)

    @torch.no_grad()
    def eval_loss(self, tokens: torch.Tensor) -> float:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.setup.bf16):
            return self.spec.loss(self.model.module, tokens).item()  # no DDP forward: nothing to reduce


def _short(filename: str) -> str:
    parts = Path(filename).parts
    return "/".join(parts[parts.index("deepspeed"):] if "deepspeed" in parts else parts[-1:])


def describe_failure(action: str, error: BaseException) -> str:
    """``"<action> raised <Type>: <message> (at <file>:<line>, called from <file>:<line>: <code>)"``.

    Files are shortened to their path inside the ``deepspeed`` package; the calling frame
    (where DeepSpeed asked for what failed, e.g. a kernel build) is named when there is one.
    """
    message = " ".join(str(error).split()) or "(no message)"
    frames = traceback.extract_tb(error.__traceback__)
    where = ""
    if frames:
        where = f" (at {_short(frames[-1].filename)}:{frames[-1].lineno}"
        if len(frames) > 1:
            caller = frames[-2]
            where += f", called from {_short(caller.filename)}:{caller.lineno}: `{(caller.line or '').strip()}`"
        where += ")"
    return f"{action} raised {type(error).__name__}: {message}{where}"


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # DeepSpeed calls torch.distributed's old collective names, whose deprecation warning
    # torch repeats on every call: it would bury the table. Only around DeepSpeed's calls.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use", category=FutureWarning)
        yield


def _guarded(action: str, call: Callable[[], Any]) -> Any:
    with _quiet():
        try:
            return call()
        except Exception as error:  # noqa: BLE001 - whatever DeepSpeed raises is reported in its row
            raise EngineFailed(describe_failure(action, error)) from error


class DeepSpeedRunner(Runner):
    """DeepSpeed's ZeRO (an optional dependency: without it the row is skipped with the import error),
    torch's AdamW passed in (``zero_allow_untested_optimizer``). Its ZeRO-3 hooks sit on the model's
    own modules, so the loss is computed by calling the wrapped module. Where DeepSpeed raises (its
    ZeRO++ quantizers have no CPU build), the error becomes the row's note (:class:`EngineFailed`)."""

    HELD = "n/a on CPU"

    def __init__(self, config: TrainConfig, spec: ModelSpec, engine_config: dict[str, Any], setup: EngineSetup) -> None:
        try:
            import deepspeed
        except ImportError as error:
            raise Unavailable(f"{config.name} needs deepspeed (make peers, or pip install 'zcomm[peers]'): "
                              f"{error}") from None  # fmt: skip
        super().__init__(spec, setup)
        self.peak_bytes = None
        model = spec.build().to(self.device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=setup.lr)
        initialize = lambda: deepspeed.initialize(model=model, optimizer=optimizer, config=engine_config)  # noqa: E731
        self.engine, *_ = _guarded(f"deepspeed {deepspeed.__version__}: deepspeed.initialize", initialize)
        self.model = self.engine.module

    def train_step(self, tokens: torch.Tensor) -> float:
        def step() -> float:
            loss = self.loss(tokens)
            self.engine.backward(loss)
            self.engine.step()
            return loss.item()

        return _guarded("a DeepSpeed training step", step)

    @torch.no_grad()
    def eval_loss(self, tokens: torch.Tensor) -> float:
        with _quiet():
            return self.loss(tokens).item()


RUNNERS: dict[str, type[Runner]] = {"zero": ZeroRunner, "fsdp2": FSDP2Runner, "ddp": DDPRunner,
                                    "deepspeed": DeepSpeedRunner}  # fmt: skip
