"""``python -m zero_runtime.checkpoint.export``: a stage-3 checkpoint of an HF GPT-2 (tied LM head, a
frozen partitioned position embedding) consolidated offline, with no process group, against
``opt.full_state_dict()`` taken when it was saved (the oracle), and as a Hugging Face folder
that ``from_pretrained`` loads with the same logits as a model given that state dict."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zero_harness import run

pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    model.transformer.wpe.requires_grad_(False)
    return model


def _save(rank: int, world: int, root: str) -> dict:
    import zero_runtime

    model, opt = zero_runtime.initialize(_gpt2(), lambda p: torch.optim.AdamW(p, lr=1e-2), CONFIG)
    for step in range(2):
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(10 * step + rank))
        opt.backward(model(input_ids=tokens, labels=tokens).loss)
        opt.step()
    opt.save_checkpoint(Path(root) / "ckpt")
    full = opt.full_state_dict()
    if rank == 0:
        model.config.save_pretrained(Path(root) / "hf-config")
    return {"full": full, "frozen_units": len(opt.frozen_units)}


def _export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zero_runtime.checkpoint.export", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_export_equals_full_state_dict_and_loads_in_hugging_face(tmp_path):
    from transformers import GPT2LMHeadModel

    results = run(_save, 2, str(tmp_path))
    full = results[0]["full"]
    assert results[0]["frozen_units"] == 1  # wpe: frozen and partitioned
    done = _export(str(tmp_path / "ckpt"), str(tmp_path / "weights.safetensors"))
    assert done.returncode == 0, done.stderr
    exported = safetensors_torch.load_file(str(tmp_path / "weights.safetensors"))
    assert exported.keys() == full.keys() and "lm_head.weight" in full  # tied name included
    for key, value in full.items():
        assert exported[key].dtype == value.dtype and torch.equal(exported[key], value), key
    assert not torch.equal(full["transformer.h.0.mlp.c_fc.weight"], _gpt2().state_dict()["transformer.h.0.mlp.c_fc.weight"])
    assert torch.equal(full["transformer.wpe.weight"], _gpt2().state_dict()["transformer.wpe.weight"])  # frozen

    done = _export(str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--hf-config", str(tmp_path / "hf-config"))
    assert done.returncode == 0, done.stderr
    probe = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(99))
    reference = _gpt2()
    reference.load_state_dict(full)
    with torch.no_grad():
        want = reference(input_ids=probe).logits
        got = GPT2LMHeadModel.from_pretrained(tmp_path / "hf")(input_ids=probe).logits
    assert torch.equal(got, want)

    # A damaged checkpoint is refused with the reason, nothing written.
    rank_file = tmp_path / "ckpt" / "rank00001.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:-10])
    done = _export(str(tmp_path / "ckpt"), str(tmp_path / "bad.safetensors"))
    assert done.returncode == 2 and "truncated or overwritten" in done.stderr
    assert not (tmp_path / "bad.safetensors").exists()
    done = _export(str(tmp_path / "nothing"), str(tmp_path / "bad.safetensors"))
    assert done.returncode == 2 and "meta.json missing" in done.stderr
