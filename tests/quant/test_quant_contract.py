"""The kernel contract as ``torch.library`` operators: one schema per op, every backend behind it.

* The schemas name no backend: torch dispatches ``zcomm::`` ops by device type (``cpu``,
  ``cuda``), and the reference oracle is the same schemas in ``zcomm_reference::``.
* ``torch.library.opcheck`` on every op, for every backend on every device it runs on
  (``any_target``), with the very calls the public functions make (recorded by a dispatch
  mode): the schema states the one mutated argument, the fake implementation matches the
  kernels, and the ops trace through AOTAutograd with dynamic shapes.
* Every backend's kernels take the op's arguments, in the op's order; the cuda backend's
  too, checked here on its module without a GPU.
* The public ops compile into one ``torch.compile`` graph that holds the ``zcomm`` ops, and
  run on fake CUDA tensors (FakeTensorMode) with every tensor they create on the GPU.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import zcomm.quant as q
from quant_cases import Target, assert_same_bytes, make_input
from zcomm.quant import _contract

NUMEL = 1200  # 2 x 3 x 200: splits into the slices and chunks below


class _Recorder(TorchDispatchMode):
    """Records every ``zcomm::`` op call (op, args) and, optionally, the device of every tensor seen."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch._ops.OpOverload, tuple[Any, ...]]] = []
        self.devices: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in (_contract.NAMESPACE, _contract.REFERENCE_NAMESPACE):
            assert not kwargs, (func, kwargs)
            self.calls.append((func, args))
        result = func(*args, **kwargs)
        for value in (*args, *kwargs.values(), result):
            if isinstance(value, torch.Tensor):
                self.devices.add(value.device.type)
        return result


def _inputs(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 tensor with NaN and Inf, and an fp32 parameter (requires grad)."""
    x = make_input(NUMEL, torch.bfloat16, "nonfinite", 1).to(device)
    return x, make_input(NUMEL, torch.float32, "normal", 2).to(device).requires_grad_()


def _public_calls(backend: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    """Each public op, INT8 with small groups and INT4 with one group per payload, as the
    collectives call them (``out=`` and fresh outputs, a parameter that requires grad)."""
    device = x.device
    for bits, group in ((8, 64), (4, q.TENSOR)):
        payload = q.quantize(weight, bits, group, backend=backend)
        rows = torch.stack([q.quantize(x, bits, group, backend=backend), payload])
        q.dequantize(rows, NUMEL, bits, group, torch.float16, backend=backend)
        chunks = q.reorder_quantize(x, (2, 0, 1), 2, bits, group, backend=backend)
        out = torch.empty(NUMEL // 2, dtype=torch.bfloat16, device=device)
        q.dequant_reduce(chunks, NUMEL // 2, bits, group, dtype=torch.bfloat16, divide_by=3.0, backend=backend, out=out)
        q.dequant_reduce(chunks, NUMEL // 2, bits, group, requant_chunks=3, backend=backend)


def _recorded(run: Callable[[], None]) -> _Recorder:
    with _Recorder() as recorder:
        run()
    return recorder


def _namespace(backend: str) -> str:
    return _contract.REFERENCE_NAMESPACE if backend == "reference" else _contract.NAMESPACE


def test_every_op_has_one_schema_with_out_and_no_backend():
    names = ["quantize", "dequantize", "reorder_quantize", "dequant_reduce", "dequant_reduce_requant"]
    assert list(_contract.OPS) == list(_contract.REFERENCE_OPS) == list(_contract.SCHEMAS) == names
    for name in names:
        schemas = [getattr(getattr(torch.ops, ns), name).default._schema for ns in ("zcomm", "zcomm_reference")]
        # the oracle's schema is the native one's, name for name and type for type
        assert [(a.name, str(a.type)) for a in schemas[0].arguments] == [
            (a.name, str(a.type)) for a in schemas[1].arguments
        ]
        for schema in schemas:
            arguments = [a.name for a in schema.arguments]
            assert "backend" not in arguments and not schema.returns, schema
            mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
            assert mutated == ["out"], schema


@pytest.mark.parametrize("op", list(_contract.OPS))
def test_opcheck(any_target: Target, op: str):
    inputs = _inputs(any_target.device)
    recorder = _recorded(lambda: _public_calls(any_target.backend, *inputs))
    namespace = _namespace(any_target.backend)
    assert {func.namespace for func, _ in recorder.calls} == {namespace}
    calls = [(func, args) for func, args in recorder.calls if func.name() == f"{namespace}::{op}"]
    assert len(calls) == (4 if op == "quantize" else 2), [func.name() for func, _ in recorder.calls]
    for func, args in calls:
        torch.library.opcheck(func, args)


@pytest.mark.parametrize(
    ("module", "backend"),
    [("reference", "reference"), ("cpu", "cpu"), ("_cuda_launch", None)],
)
def test_backend_kernels_take_the_ops_arguments(module: str, backend: str | None):
    """``_cuda_launch`` holds the cuda backend's kernels; ``backends/cuda.py`` registers them
    for every op once the backend can run, which needs a GPU."""
    kernels = importlib.import_module(f"zcomm.quant.backends.{module}")
    for name in _contract.OPS:
        schema = getattr(torch.ops.zcomm, name).default._schema
        expected = [a.name for a in schema.arguments]
        kernel = getattr(kernels, name)
        assert list(inspect.signature(kernel).parameters) == expected, (module, name)
        if backend is not None:
            assert _contract._KERNELS[(name, backend)] is kernel


def test_public_ops_compile_into_one_graph():
    """fullgraph: the argument checks trace, and the graph calls the zcomm ops themselves."""
    graphs = []

    def keep_graph(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(gm)
        return gm.forward

    def round_trip(x: torch.Tensor) -> torch.Tensor:
        rows = q.reorder_quantize(x, (1, 0), 2, 8, 64, backend="cpu")
        summed = q.dequant_reduce(rows, x.numel() // 2, 8, 64, requant_chunks=2, backend="cpu")
        return q.dequantize(summed, x.numel() // 4, 8, 64, torch.float32, backend="cpu")

    x = make_input(NUMEL, torch.float32, "normal", 3)
    compiled = torch.compile(round_trip, backend=keep_graph, fullgraph=True)
    assert_same_bytes(compiled(x), round_trip(x), "compiled round trip")
    targets = {str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"}
    ops = ("reorder_quantize", "dequant_reduce_requant", "dequantize")
    assert {f"zcomm.{op}.default" for op in ops} <= targets


@pytest.mark.parametrize("backend", ("cuda", "reference"))
def test_ops_on_fake_cuda_tensors_stay_on_the_gpu(backend: str):
    """No GPU here: FakeTensorMode makes CUDA tensors, and the ops' fake implementations give
    their outputs; every tensor the public ops create or touch is a CUDA tensor."""
    with FakeTensorMode():
        x = torch.empty(NUMEL, dtype=torch.bfloat16, device="cuda")
        weight = torch.empty(NUMEL, device="cuda", requires_grad=True)
        recorder = _recorded(lambda: _public_calls(backend, x, weight))
    namespace = _namespace(backend)
    assert {func.name() for func, _ in recorder.calls} == {f"{namespace}::{name}" for name in _contract.OPS}
    assert recorder.devices == {"cuda"}
