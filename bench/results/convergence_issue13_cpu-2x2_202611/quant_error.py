# Command: PYTHONPATH=. python bench/results/convergence_issue13_cpu-2x2_202611/quant_error.py (single process, CPU)
"""Per-parameter relative RMS error of INT8 (qwZ) / INT4 (qgZ-like, on gradients) quantization
of TinyGPT's persistent unit (world 4), packed vs aligned, for several group sizes."""
import torch
from bench.train.models import TinyGPT, GPTConfig
from bench.train.data import VOCAB_SIZE
from zero_runtime._flat_buffer import FlatLayout
import zcomm.quant as quant
torch.manual_seed(0)
m = TinyGPT(GPTConfig(vocab_size=VOCAB_SIZE, seq_len=128, d_model=128, n_heads=4, n_layers=4))
params = list(m.parameters())[::-1]
x = torch.randint(0, 256, (8, 129))
logits = m(x[:, :-1]); loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1)); loss.backward()
grads = [p.grad for p in params]
def err(tensors, bits, g, align):
    lay = FlatLayout([t.shape for t in tensors], world_size=4, align=align)
    flat = lay.flatten([t.detach() for t in tensors], dtype=torch.float32)
    out = torch.empty_like(flat)
    for r in range(4):
        lo, hi = lay.shard_range(r)
        out[lo:hi] = quant.dequantize(quant.quantize(flat[lo:hi], bits, g), hi-lo, bits, g, torch.float32)
    rel = [((v - t).norm() / t.norm()).item() for v, t in zip(lay.views(out), tensors) if t.norm() > 0]
    tot = ((out - flat).norm() / flat.norm()).item()
    return max(rel), sum(rel)/len(rel), tot, lay.numel
for name, ts, bits in (("weights INT8", params, 8), ("grads INT4", grads, 4)):
    for g in (2048, 512, 256, 128):
        for a in (1, g):
            mx, mean, tot, n = err(ts, bits, g, a)
            print(f"{name} g={g:5d} {'aligned' if a>1 else 'packed '}: max per-param rel err {mx:.4f}, mean {mean:.4f}, whole {tot:.4f}, numel {n}")
