"""The models ``python -m bench.train`` can train, behind one small interface.

``tinygpt`` is the project's own byte-level decoder (``bench.models.TinyGPT``, tied
embedding). ``hf-gpt2`` is an unmodified Hugging Face ``GPT2LMHeadModel`` built from a
small ``GPT2Config`` (random init, nothing downloaded), to show that a third-party model
trains with no change to its code. Both take a ``(batch, seq_len + 1)`` window of byte
tokens and return the mean next-token cross-entropy over its last ``seq_len`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from bench.models import GPTConfig, TinyGPT
from bench.text_data import SEPARATOR, VOCAB_SIZE
from bench.train_runner import Unavailable

MODELS = ("tinygpt", "hf-gpt2")


@dataclass(frozen=True, kw_only=True)
class ModelSize:
    """Shape shared by both models; ``seq_len`` is the number of predicted tokens."""

    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4

    def __post_init__(self) -> None:
        for name in ("seq_len", "d_model", "n_layers", "n_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} must be divisible by n_heads={self.n_heads}")


@dataclass(frozen=True)
class ModelSpec:
    """How to build a model, compute its loss, and find its repeated blocks (FSDP2 units)."""

    build: Callable[[], nn.Module]
    loss: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    blocks: Callable[[nn.Module], list[nn.Module]]


def model_spec(name: str, size: ModelSize) -> ModelSpec:
    if name == "tinygpt":
        return _tinygpt_spec(size)
    if name == "hf-gpt2":
        return _hf_gpt2_spec(size)
    raise ValueError(f"unknown model {name!r}; choose from {MODELS}")


def _tinygpt_spec(size: ModelSize) -> ModelSpec:
    # TinyGPT's position table covers the inputs, i.e. the window minus its last token.
    config = GPTConfig(
        vocab_size=VOCAB_SIZE, seq_len=size.seq_len, d_model=size.d_model, n_heads=size.n_heads, n_layers=size.n_layers
    )
    return ModelSpec(
        build=lambda: TinyGPT(config),
        loss=lambda model, tokens: model.loss(tokens),
        blocks=lambda model: list(model.blocks),
    )


def _hf_gpt2_spec(size: ModelSize) -> ModelSpec:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as error:
        raise Unavailable(f"hf-gpt2 needs transformers (pip install 'zcomm[peers]'): {error}") from None
    # Dropout off so every configuration sees the same function of the weights; the
    # separator byte stands in for GPT-2's bos/eos, which must lie inside the vocabulary.
    config = GPT2Config(
        vocab_size=VOCAB_SIZE,
        n_positions=size.seq_len + 1,
        n_embd=size.d_model,
        n_layer=size.n_layers,
        n_head=size.n_heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=SEPARATOR,
        eos_token_id=SEPARATOR,
    )
    # GPT-2 shifts labels itself, so the whole window goes in and its loss covers the same
    # seq_len targets as TinyGPT's.
    return ModelSpec(
        build=lambda: GPT2LMHeadModel(config),
        loss=lambda model, tokens: model(input_ids=tokens, labels=tokens).loss,
        blocks=lambda model: list(model.transformer.h),
    )
