"""Diagnostic: after a forward with fast, list saved storages still alive and how they were judged."""
import gc, sys, torch
import actoffload as ao
from actoffload.memory import SavedTracker
from actoffload.models import Block, GPTConfig

d, L, T, B = (int(a) for a in (sys.argv[1:] or [2048, 2, 2048, 2]))
cfg = GPTConfig(d_model=d, n_heads=d // 128, n_layers=L, seq_len=T)
stack = torch.nn.Sequential(*[Block(cfg) for _ in range(L)]).cuda().bfloat16()
x = torch.randn(B, T, d, device="cuda", dtype=torch.bfloat16)
for mode in ("none", "fast"):
    off = ao.Offloader(impl="fast", keep_last=1) if mode == "fast" else None
    h = ao.wrap(stack, off) if off else None
    inp = x.clone().requires_grad_(True)
    gc.collect(); torch.cuda.synchronize(); base = torch.cuda.memory_allocated()
    with SavedTracker(off, exclude=stack.parameters()) as tr:
        out = stack(inp)
    torch.cuda.synchronize()
    if off: off.synchronize()
    gc.collect()
    alive = [(n, k) for k, (ref, n) in tr._seen.items() if not ref.expired()]
    print(mode, "allocated MB", (torch.cuda.memory_allocated() - base) / 2**20, "alive saved MB", sum(n for n, _ in alive) / 2**20)
    if off:
        s = off.stats(); print({g: (v["offloaded_bytes"] / 2**20, v["kept"]) for g, v in s["groups"].items()})
        # storages offloaded by a group but still alive
        import actoffload.engine as E
        groups = [o for o in gc.get_objects() if type(o) is E.Group]
        for g in groups:
            for m in g.moved:
                print("  moved", g.name, m.nbytes / 2**20, "MB storage still referenced:", m.storage is not None)
        print(sorted([n / 2**20 for n, _ in alive], reverse=True)[:20])
    out.float().sum().backward()
    if h: h.remove()
    del out, inp
