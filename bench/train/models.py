"""The models of ``python -m bench.train`` (also the runtime tests' workloads), behind one small interface.

``TinyGPT`` is a byte-level GPT-style decoder whose LM head is tied to the token embedding:
the same ``nn.Parameter`` is used by two modules, which is exactly the case a ZeRO-3 runtime
must handle. ``hf-gpt2`` is an unmodified Hugging Face ``GPT2LMHeadModel`` of the same shape
(random init, nothing downloaded): a third-party model trains with no change to its code.
Both take a ``(batch, seq_len + 1)`` window of byte tokens and return the mean next-token
cross-entropy over its last ``seq_len`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .data import SEPARATOR

MODELS = ("tinygpt", "hf-gpt2")


class Unavailable(RuntimeError):
    """An optional dependency (an engine or a model library) is missing: skip with this note."""


class MLP(nn.Module):
    def __init__(self, d_in: int = 32, d_hidden: int = 64, d_out: int = 8, depth: int = 3) -> None:
        super().__init__()
        dims = [d_in] + [d_hidden] * (depth - 1) + [d_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:], strict=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = F.gelu(layer(x))
        return self.layers[-1](x)


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """The shape of every model here; ``seq_len`` tokens are predicted per sample (TinyGPT's positions)."""

    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2

    def __post_init__(self) -> None:
        if min(self.vocab_size, self.seq_len, self.d_model, self.n_heads, self.n_layers) < 1 or self.d_model % self.n_heads:
            raise ValueError(f"every size must be >= 1 and d_model divisible by n_heads, got {self}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.n_heads, dim // self.n_heads).unbind(dim=2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, dim))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """Byte-level decoder; ``forward(tokens)`` returns logits, ``loss(tokens)`` next-token CE."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.tok.weight
        # nn.Embedding's N(0, 1) init, read through the tied head, gives logits of size
        # sqrt(d_model); GPT-2's 0.02 keeps the initial loss near log(vocab_size).
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        return next_token_loss(self, tokens)


def next_token_loss(forward: Callable[[torch.Tensor], torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of ``forward``'s logits for every token of ``tokens`` but the first."""
    logits = forward(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


@dataclass(frozen=True)
class ModelSpec:
    """How to build a model, compute its loss by calling it (or the engine's module wrapping it, e.g.
    DDP's, whose forward must run), and find its repeated blocks (FSDP2 units)."""

    build: Callable[[], nn.Module]
    loss: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    blocks: Callable[[nn.Module], list[nn.Module]]


def model_spec(name: str, config: GPTConfig) -> ModelSpec:
    """The model ``name`` of :data:`MODELS` in the shape ``config``."""
    if name == "tinygpt":
        return ModelSpec(build=lambda: TinyGPT(config), loss=next_token_loss,
                         blocks=lambda model: list(model.blocks))  # fmt: skip
    if name == "hf-gpt2":
        return _hf_gpt2_spec(config)
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


def _hf_gpt2_spec(config: GPTConfig) -> ModelSpec:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as error:
        raise Unavailable(f"hf-gpt2 needs transformers (pip install 'zcomm[hf]'): {error}") from None
    # Dropout off so every configuration sees the same function of the weights; the
    # separator byte stands in for GPT-2's bos/eos, which must lie inside the vocabulary.
    hf_config = GPT2Config(vocab_size=config.vocab_size, n_positions=config.seq_len + 1, n_embd=config.d_model,
                           n_layer=config.n_layers, n_head=config.n_heads, resid_pdrop=0.0, embd_pdrop=0.0,
                           attn_pdrop=0.0, bos_token_id=SEPARATOR, eos_token_id=SEPARATOR)  # fmt: skip
    # GPT-2 shifts labels itself, so the whole window goes in and its loss covers the same
    # seq_len targets as TinyGPT's.
    return ModelSpec(build=lambda: GPT2LMHeadModel(hf_config), blocks=lambda model: list(model.transformer.h),
                     loss=lambda model, tokens: model(input_ids=tokens, labels=tokens).loss)  # fmt: skip
