"""After install: import each dependency and, on a GPU, run one tiny operation with it.

VERIFY_SCRIPT runs in the pod's venv and prints one JSON object {name: "ok ..." | "error ..."}.
"""

VERIFY_SCRIPT = r'''
import json, sys
out = {}
def check(name, fn):
    try:
        out[name] = "ok " + (fn() or "")
    except Exception as exc:
        out[name] = "error %s: %s" % (type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
def torch_op():
    import torch
    if torch.cuda.is_available():
        a = torch.randn(64, 64, device="cuda")
        (a @ a).sum().item()
        return "%s on %s" % (torch.__version__, torch.cuda.get_device_name(0))
    return "%s (CPU)" % torch.__version__
check("torch", torch_op)
names = sys.argv[1:]
def bnb_op():
    import torch, bitsandbytes as bnb
    if torch.cuda.is_available():
        p = torch.nn.Parameter(torch.randn(4096, device="cuda"))
        opt = bnb.optim.AdamW8bit([p])
        p.grad = torch.randn_like(p)
        opt.step()
        return bnb.__version__ + ", 8-bit AdamW step on GPU"
    return bnb.__version__
def ao_op():
    import torch, torchao
    from torchao.optim import AdamW8bit
    if torch.cuda.is_available():
        p = torch.nn.Parameter(torch.randn(4096, device="cuda"))  # 4096 values: quantized (torchao/optim/adam.py)
        opt = AdamW8bit([p])
        p.grad = torch.randn_like(p)
        opt.step()
        return torchao.__version__ + ", 8-bit AdamW step on GPU"
    return torchao.__version__
def fa_op():
    import torch, flash_attn
    from flash_attn import flash_attn_func
    if torch.cuda.is_available():
        q = torch.randn(1, 16, 2, 64, device="cuda", dtype=torch.bfloat16)
        flash_attn_func(q, q, q, causal=True).sum().item()
        return flash_attn.__version__ + ", forward on GPU"
    return flash_attn.__version__
def nvml_op():
    import pynvml
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return "imported (no NVIDIA driver)"
    return "%d GPU(s)" % pynvml.nvmlDeviceGetCount()
ops = {"bitsandbytes": bnb_op, "torchao": ao_op, "flash-attn": fa_op, "nvidia-ml-py": nvml_op}
for name in names:
    if name in ops:
        check(name, ops[name])
print(json.dumps(out))
'''
