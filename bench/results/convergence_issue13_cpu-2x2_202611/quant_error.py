# Command: PYTHONPATH=. python bench/results/convergence_issue13_cpu-2x2_202611/quant_error.py (single process, CPU)
"""Per-parameter relative RMS error of INT8 (qwZ) / INT4 (qgZ-like, on gradients) quantization
of TinyGPT's persistent unit (world 4), packed vs aligned, for several group sizes."""
import torch
from bench.train.models import TinyGPT, GPTConfig
from bench.train.data import VOCAB_SIZE
import zcomm.quant as quant
torch.manual_seed(0)
m = TinyGPT(GPTConfig(vocab_size=VOCAB_SIZE, seq_len=128, d_model=128, n_heads=4, n_layers=4))
params = list(m.parameters())[::-1]
x = torch.randint(0, 256, (8, 129))
logits = m(x[:, :-1]); loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1)); loss.backward()
grads = [p.grad for p in params]
def up(n, a):
    return -(-n // a) * a
def err(tensors, bits, g, align, world=4):
    # zero_runtime's layout, written out: offsets rounded up to align, total to world * align
    offsets, end = [], 0
    for t in tensors:
        offsets.append(up(end, align)); end = offsets[-1] + t.numel()
    numel = up(max(end, 1), world * align); shard = numel // world
    flat = torch.zeros(numel)
    for o, t in zip(offsets, tensors):
        flat[o:o + t.numel()] = t.detach().reshape(-1)
    out = torch.empty_like(flat)
    for r in range(world):
        lo, hi = r * shard, (r + 1) * shard
        out[lo:hi] = quant.dequantize(quant.quantize(flat[lo:hi], bits, g), hi-lo, bits, g, torch.float32)
    views = [(out[o:o + t.numel()], t.detach().reshape(-1)) for o, t in zip(offsets, tensors)]
    rel = [((v - t).norm() / t.norm()).item() for v, t in views if t.norm() > 0]
    tot = ((out - flat).norm() / flat.norm()).item()
    return max(rel), sum(rel)/len(rel), tot, numel
for name, ts, bits in (("weights INT8", params, 8), ("grads INT4", grads, 4)):
    for g in (2048, 512, 256, 128):
        for a in (1, g):
            mx, mean, tot, n = err(ts, bits, g, a)
            print(f"{name} g={g:5d} {'aligned' if a>1 else 'packed '}: max per-param rel err {mx:.4f}, mean {mean:.4f}, whole {tot:.4f}, numel {n}")
