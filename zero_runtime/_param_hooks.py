"""Stage 3's automatic data movement: module hooks that drive the ``ParamScheduler``.

* forward pre-hook: push the module on the call stack and acquire the units that own its
  directly registered parameters (a tied LM head acquires the embedding's unit) and the
  fused units rooted at it (the lowest module holding all of a unit's parameters: a fused
  block is gathered once for the whole block, not re-gathered per child);
* forward post-hook: register a hook on the module's outputs that, when their gradient
  arrives, gathers every unit the module used for backward; then release its units;
* attribute access: each module with managed parameters gets a subclass whose
  ``__getattr__`` gathers a parameter's unit if it is read while freed. Inside a forward the
  unit is attributed to the innermost running module (released with it, re-gathered for its
  backward), so parameters used outside their own module work. Outside any forward the unit
  stays gathered until the end of the next backward or step.

[Note: module hook ordering] Pre-hooks run outermost first and post-hooks innermost first,
so the stack top is always the innermost running module. Output gradient hooks are pre-hooks of the
node that produced the output, so they fire before any autograd node of that module.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ._partition import FlatUnit, GatherState
from ._stage3 import ParamScheduler

_ACCESS_CLASSES: dict[type, type] = {}


class ModuleHooks:
    def __init__(self, *, model: nn.Module, units: list[FlatUnit], scheduler: ParamScheduler) -> None:
        self.scheduler = scheduler
        # keyed by id: a Parameter's __hash__ is a Python call, and this is looked up per parameter read;
        # the units hold their parameters, so an id is never reused while it is a key
        self.unit_of: dict[int, FlatUnit] = {id(p): u for u in units for p in u.params}
        self._stack: list[nn.Module] = []
        self._used: dict[nn.Module, list[FlatUnit]] = {}
        self._needed: dict[nn.Module, list] = {}
        self.outside: list[FlatUnit] = []
        self._static: dict[nn.Module, list[FlatUnit]] = {}
        self._with_frozen: set[nn.Module] = set()  # modules that use a frozen unit (fixed at start-up)
        rooted = _units_by_root(model, units)
        for module in model.modules():
            units_here = list(rooted.get(module, []))
            for param in module.parameters(recurse=False):
                unit = self.unit_of.get(id(param))
                if unit is not None and unit not in units_here:
                    units_here.append(unit)
            self._static[module] = units_here
            if any(unit.frozen for unit in units_here):
                self._with_frozen.add(module)
            module.register_forward_pre_hook(self._pre_forward)
            module.register_forward_hook(self._post_forward)
            if units_here:
                _install_access_hook(module, self)

    def _pre_forward(self, module: nn.Module, args: tuple) -> None:
        self._stack.append(module)
        used: list[FlatUnit] = []
        self._used[module] = used
        self._needed[module] = needed = []  # set when backward reaches this call's outputs
        for unit in self._static[module]:
            self._use(module, unit)
        if module in self._with_frozen and torch.is_grad_enabled():
            _on_all_input_grads(args, lambda: self._frozen_backward_done(used, needed))

    def _backward_needs(self, used: list[FlatUnit], needed: list) -> None:
        needed.append(True)
        self.scheduler.need_for_backward(used)

    def _frozen_backward_done(self, used: list[FlatUnit], needed: list) -> None:
        """This call's input gradients are final, so its backward no longer needs the frozen
        units it used (see [Note: frozen units] in ``_partition``); a call whose outputs
        backward never reached holds nothing."""
        if needed:
            for unit in used:
                if unit.frozen:
                    self.scheduler.frozen_backward_done(unit)

    def _post_forward(self, module: nn.Module, args: tuple, output: object) -> None:
        popped = self._stack.pop()
        assert popped is module, "forward hooks ran out of order"
        used = self._used.pop(module)
        needed = self._needed.pop(module)
        if torch.is_grad_enabled():
            _on_first_output_grad(output, lambda: self._backward_needs(used, needed))
        for unit in used:
            self.scheduler.release(unit)

    def _use(self, module: nn.Module, unit: FlatUnit) -> None:
        used = self._used[module]
        if unit not in used:
            self.scheduler.acquire(unit)
            used.append(unit)

    def on_access(self, param: nn.Parameter) -> None:
        unit = self.unit_of.get(id(param))
        if unit is None:
            return
        if self._stack:
            self._use(self._stack[-1], unit)
        elif unit.state is not GatherState.READY:
            self.scheduler.acquire(unit)
            self.outside.append(unit)

    def running(self) -> bool:
        """Whether a forward of a managed module is running."""
        return bool(self._stack)

    def end_of_outside_uses(self) -> None:
        """Outside-forward readers are done (end of backward, or the weights change)."""
        self.outside.clear()


def _units_by_root(model: nn.Module, units: list[FlatUnit]) -> dict[nn.Module, list[FlatUnit]]:
    """Each unit under the lowest module whose subtree holds all its parameters (their first
    names share that module's path)."""
    rooted: dict[nn.Module, list[FlatUnit]] = {}
    for unit in units:
        common = os.path.commonprefix([name.split(".")[:-1] for name in unit.names])
        rooted.setdefault(model.get_submodule(".".join(common)), []).append(unit)
    return rooted


def _on_first_output_grad(output: object, callback) -> None:
    if isinstance(output, torch.Tensor):  # most modules: no pytree walk
        tensors = [output] if output.requires_grad else []
    else:
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    fired = []

    def hook(grad: torch.Tensor) -> None:
        if not fired:
            fired.append(True)
            callback()

    for tensor in tensors:
        tensor.register_hook(hook)


def _on_all_input_grads(args: object, callback) -> None:
    """Call ``callback`` once the gradients of all of ``args``' tensors that require grad
    are final (a tensor hook fires when its gradient is fully accumulated, i.e. after every
    consumer, this module included, ran its backward). Without such inputs, never: the
    unit is then freed at the end of backward."""
    tensors = list({id(t): t for t in tree_flatten(args)[0]
                    if isinstance(t, torch.Tensor) and t.requires_grad}.values())
    remaining = [len(tensors)]

    def hook(grad: torch.Tensor) -> None:
        remaining[0] -= 1
        if remaining[0] == 0:
            callback()

    for tensor in tensors:
        tensor.register_hook(hook)


def _install_access_hook(module: nn.Module, hooks: ModuleHooks) -> None:
    """Swap ``module``'s class for a cached subclass whose ``__getattr__`` (reached for every
    registered parameter, since they live in ``_parameters``) reports parameter reads."""
    cls = type(module)
    sub = _ACCESS_CLASSES.get(cls)
    if sub is None:
        original = cls.__getattr__

        def __getattr__(self, name: str):
            value = original(self, name)
            owner = self.__dict__.get("_zero_hooks")
            if owner is not None and isinstance(value, nn.Parameter):
                owner.on_access(value)
            return value

        sub = type(f"Zero3{cls.__name__}", (cls,), {"__getattr__": __getattr__})
        _ACCESS_CLASSES[cls] = sub
    module.__dict__["_zero_hooks"] = hooks
    module.__class__ = sub
