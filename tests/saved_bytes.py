"""What autograd saves under one module of a real forward: the count the activation checks compare with podkit's."""

from __future__ import annotations

import torch


def saved_under(module, skip: set, run) -> int:
    """Bytes of the storages autograd saves while `module` runs inside `run()`, each once, leaving out the storages in
    `skip` (parameters, buffers) and any saved first outside it (the rotary cos/sin an earlier layer saved)."""
    inside = []
    pre = module.register_forward_pre_hook(lambda m, a: inside.append(1))
    post = module.register_forward_hook(lambda m, a, o: inside.pop() and None)
    seen, total = set(), []

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip | seen:
            seen.add(storage.data_ptr())
            if inside:
                total.append(storage.nbytes())
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
    finally:
        pre.remove()
        post.remove()
    return sum(total)
