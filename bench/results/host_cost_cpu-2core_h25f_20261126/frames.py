"""The Python frames one call enters on the caller's thread (the calling lambda not counted), as
tests/quant/test_host_path.py counts them; the chain's zcomm frames on the worker for the qgZ rows."""
import sys, tempfile
sys.path.insert(0, "tests"); sys.path.insert(0, "tests/quant")
import torch, torch.distributed as dist
import zcomm
from frame_count import entered_functions
import test_host_path as t
tmp = tempfile.mkdtemp()
dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
x, out = torch.randn(t.NUMEL), torch.empty(t.NUMEL)
zcomm.all_gather_q8(out, x)
print("all_gather_q8 caller", len(entered_functions(lambda: zcomm.all_gather_q8(out, x))) - 1)
zcomm.reduce_scatter_q4(out, x)
print("reduce_scatter_q4 caller", len(entered_functions(lambda: zcomm.reduce_scatter_q4(out, x))) - 1)
inputs = [torch.randn(n) for n in (100, 200, 300, 424)]
flat = torch.empty(t.NUMEL); outputs = list(flat.split([100, 200, 300, 424]))
e, c = t._chain_frames(lambda: zcomm.reduce_scatter_q4_coalesced(outputs, inputs))
print("coalesced caller", len(e), "chain", len(c))
fb = zcomm.ErrorFeedback()
e, c = t._chain_frames(lambda: zcomm.reduce_scatter_q4(out, x, error_feedback=fb))
print("feedback caller", len(e), "chain", len(c))
from zcomm.all_gather_q8 import prepare_all_gather_q8
from zcomm.reduce_scatter_q4 import prepare_reduce_scatter_q4_coalesced
g = prepare_all_gather_q8(out, x); g(out, x)
print("prepared gather caller", len(entered_functions(lambda: g(out, x))) - 1)
r = prepare_reduce_scatter_q4_coalesced(outputs, inputs); r(outputs, inputs)
print("prepared reduce caller", len(entered_functions(lambda: r(outputs, inputs))) - 1)
if "-v" in sys.argv:
    print("\n".join(entered_functions(lambda: zcomm.all_gather_q8(out, x))))
    print("---")
    print("\n".join(entered_functions(lambda: zcomm.reduce_scatter_q4_coalesced(outputs, inputs))))
dist.destroy_process_group()
