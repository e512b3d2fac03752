"""The models a dry run can train: built-in specs and a user's ``module:callable`` factory.

A model spec is a string (``--model`` of ``python -m zero_runtime.estimate --dry-run``):

* ``gpt[:key=value,...]``: a GPT-2-like decoder (token and position embeddings, ``layers``
  pre-norm blocks of causal self-attention and a 4x MLP, a final LayerNorm, an LM head tied
  to the token embedding), keys ``layers`` (4), ``dim`` (512), ``heads`` (8), ``vocab``
  (32000), ``seq`` (256); its batch is random token ids, its loss the next-token
  cross-entropy;
* ``mlp:params=N[,layers=K]``: only a parameter count: ``K`` (8) bias-free square Linear
  layers of about ``N / K`` parameters each; its loss is the mean square of its output;
* ``package.module:callable``: ``callable()`` returns ``(model, inputs)``, ``inputs`` a
  tensor or a tuple of positional arguments of ``model``; its loss is the output if that is
  a one-element tensor, else ``output.loss`` if it has one, else the mean square of the output.

Every rank builds the same model from the same seed, as ``initialize`` requires.
"""

from __future__ import annotations

import importlib
import math
from typing import Any, Callable, NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

SEED = 0
GPT_DEFAULTS = {"layers": 4, "dim": 512, "heads": 8, "vocab": 32000, "seq": 256}
MLP_DEFAULTS = {"layers": 8}


class DryRunModel(NamedTuple):
    """A model, the positional arguments of one micro-batch, and its loss from the output."""

    model: nn.Module
    inputs: tuple[Any, ...]
    loss: Callable[[Any], torch.Tensor]


def build_model(spec: str, *, micro_batch: int) -> DryRunModel:
    """The model of ``spec`` (module docstring) with one micro-batch of ``micro_batch`` samples
    (used by the built-in specs; a factory makes its own inputs). ``ValueError`` for a bad spec."""
    torch.manual_seed(SEED)
    kind, _, rest = spec.partition(":")
    if kind == "gpt":
        cfg = _options(spec, rest, GPT_DEFAULTS, required=())
        if cfg["dim"] % cfg["heads"]:
            raise ValueError(f"model spec {spec!r}: dim {cfg['dim']} is not a multiple of heads {cfg['heads']}")
        model = TinyGPT(**cfg)
        tokens = torch.randint(0, cfg["vocab"], (micro_batch, cfg["seq"] + 1))
        return DryRunModel(model, (tokens,), lambda loss: loss)
    if kind == "mlp":
        cfg = _options(spec, rest, {**MLP_DEFAULTS, "params": None}, required=("params",))
        dim = max(1, round(math.sqrt(cfg["params"] / cfg["layers"])))
        model = nn.Sequential(*(nn.Linear(dim, dim, bias=False) for _ in range(cfg["layers"])))
        return DryRunModel(model, (torch.randn(micro_batch, dim),), _mean_square)
    if rest and "=" not in rest:
        return _from_factory(spec)
    raise ValueError(f"unknown model spec {spec!r}: use gpt[:layers=..,dim=..,heads=..,vocab=..,seq=..], "
                     "mlp:params=N[,layers=K] or package.module:callable")


def _options(spec: str, text: str, defaults: dict[str, int | None], *, required: tuple[str, ...]) -> dict[str, int]:
    """``key=value`` pairs of ``text`` over ``defaults`` (values like ``1e8`` allowed when integral)."""
    found = dict(defaults)
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in defaults:
            raise ValueError(f"model spec {spec!r}: {item!r} is not one of {', '.join(f'{k}=...' for k in defaults)}")
        number = float(value)
        if number != int(number) or number < 1:
            raise ValueError(f"model spec {spec!r}: {key} must be a positive integer, got {value!r}")
        found[key] = int(number)
    missing = [key for key in required if found[key] is None]
    if missing:
        raise ValueError(f"model spec {spec!r} needs {', '.join(f'{k}=...' for k in missing)}")
    return found  # type: ignore[return-value]


def _from_factory(spec: str) -> DryRunModel:
    module_name, _, attr = spec.partition(":")
    factory = getattr(importlib.import_module(module_name), attr, None)
    if not callable(factory):
        raise ValueError(f"model spec {spec!r}: {module_name} has no callable {attr!r}")
    made = factory()
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module)):
        raise ValueError(f"model spec {spec!r}: {attr}() must return (model, inputs), got {type(made).__name__}")
    model, inputs = made
    return DryRunModel(model, inputs if isinstance(inputs, tuple) else (inputs,), _factory_loss)


def _mean_square(output: torch.Tensor) -> torch.Tensor:
    return output.float().pow(2).mean()


def _factory_loss(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor) and output.numel() == 1:
        return output.float().reshape(())
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, torch.Tensor):
        return _mean_square(output)
    raise ValueError(f"the model's output ({type(output).__name__}) is not a tensor and has no .loss")


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc, self.out = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, seq, 3, self.heads, dim // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class TinyGPT(nn.Module):
    """GPT-2's layout at any size; ``forward(tokens)`` returns the next-token loss of ``tokens``."""

    def __init__(self, *, layers: int, dim: int, heads: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        x = self.embed(inputs) + self.pos(torch.arange(inputs.shape[1], device=inputs.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
