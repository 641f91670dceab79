"""Seeded, printable training scenarios for differential testing.

A :class:`Scenario` is plain data (JSON-serializable): the layers of each group, the
offloader options, micro-batches, and what happens around them (marks, retain_graph,
checkpointing, an exception, an in-place write after a save, a delayed stream), and what
users do around a training loop (``P`` says how often each is drawn): activation checkpointing around groups,
several steps under a plan that recomputes (fast's warm-up, a memory budget) with the
state a recomputation must see changed between forward and backward, one module at
several positions, thousands of tiny groups or one long chain, storages freed with
``resize_(0)`` and refilled before backward.
:func:`generate` draws one from a seed; :func:`shrinks` lists smaller variants, so a
failure can be reduced to a minimal reproduction; :func:`themes` names what a scenario
exercises.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field, replace

LAYERS = (
    "linear", "layernorm", "rmsnorm", "attention", "gelu_mlp", "swiglu_mlp",
    "transpose", "slice", "reshape", "expand", "as_strided", "inplace_before_save",
    "quantized", "grouped", "grouped_mlp", "grouped_mlp_selected",
    "complex", "wrapper_subclass", "forward_ad", "nested", "parameter_swap", "detached_weight", "compiled",
)
# Recomputing is checkpointing: a forward with a side effect (a parameter's .data replaced)
# has it twice, and backward sees the result; checkpoint cannot save nested tensors (the
# offloader raises, naming the group). Both are documented; tests/test_warmup.py covers them.
_NOT_RECOMPUTABLE = {"parameter_swap", "nested"}
MARKS = (None, None, None, "veto_before", "veto_after", "optin_before", "optin_after")
# Layer kinds a theme inserts (never drawn from LAYERS, so the scenarios of old seeds stay):
# "dropout" reads the training flag, "attribute" plain attributes (float, str, tuple),
# "resizable" saves a tensor whose storage the runner frees with resize_(0) and refills,
# "chain" a long chain of ops (``Scenario.chain`` of them) in one group.
THEME_LAYERS = ("dropout", "attribute", "resizable", "chain")
CHECKPOINT_KINDS = ("nonreentrant", "reentrant", "selective")
# Changes a recomputation must not see (the forward's state is what it recomputes with):
# "functional_call" runs the model with tensors other than its parameters, "eval" switches
# to model.eval() between the loss and backward, "attribute" changes a plain attribute the
# forward read, "inplace_residual" writes the residual stream in place: h += block(h).
TWISTS = ("functional_call", "eval", "attribute", "inplace_residual")
BUDGETS = ("huge", "small", "mid")  # runner.budget_bytes says what each is


@dataclass
class Scenario:
    seed: int
    device: str = "cpu"
    dtype: str = "float32"
    groups: list[list[str]] = field(default_factory=lambda: [["linear"]])
    marks: dict[str, str] = field(default_factory=dict)  # "g.i" (group.layer) -> mark
    checkpoint: list[str] = field(default_factory=list)  # "g.i" layers run under torch.utils.checkpoint
    policy: str = "all"
    keep_last: int = 1
    prefetch: int = 1  # fast only
    max_inflight: int = 1  # fast only
    min_offload_bytes: int = 0
    pack_below: int | None = None  # fast only: None keeps its default
    use_wrap: bool = False
    microbatches: int = 1
    backward_order: list[int] = field(default_factory=lambda: [0])
    retain_graph: bool = False  # micro-batch 0 runs backward twice
    raise_in_group: int | None = None  # an extra forward that fails inside this group first
    inplace_after_save: str | None = None  # "g.i": that layer's saved activation is written after the save
    delay: str | None = None  # CUDA: "d2h" | "h2d" | "compute": a stream made to lag far behind
    in_except: bool = False  # the forwards run while an unrelated exception is being handled
    same_names: bool = False  # every group has the same name (a block reused across depth)
    warmup: str = "offload"  # fast only: "recompute" recomputes the wrapped groups while it pins
    # ---- what users do (drawn after the fields above, so those stay what they were for a seed)
    checkpoint_kind: str = "nonreentrant"  # how the layers of ``checkpoint`` are checkpointed (CHECKPOINT_KINDS)
    # checkpoint regions around positions: {"first": p, "last": q, "kind": CHECKPOINT_KINDS,
    # "outside": an op saving outside any group before each group of the region}
    regions: list[dict] = field(default_factory=list)
    steps: int = 1  # training steps (a budget profiles 2 steps and then plans)
    memory_budget: str | None = None  # fast only: "huge" | "small" | "mid" (BUDGETS)
    twists: list[str] = field(default_factory=list)  # TWISTS
    order: list[int] | None = None  # the group (block) run at each position; one at several positions is shared
    wrap_dict: bool = False  # ao.wrap is given an nn.ModuleDict of the positions' blocks
    deep: int = 0  # that many tiny groups after the others
    chain: int = 0  # ops in each "chain" layer
    resize: str | None = None  # "after_group" | "after_forward": "resizable" layers' saves freed then, refilled before backward
    width: int = 16
    seq: int = 8
    batch: int = 2

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> "Scenario":
        return Scenario(**json.loads(text))

    def __str__(self) -> str:
        opts = [f"seed={self.seed}", self.dtype, f"groups={'|'.join(','.join(g) for g in self.groups)}",
                f"policy={self.policy}", f"keep_last={self.keep_last}", f"prefetch={self.prefetch}", f"inflight={self.max_inflight}",
                f"min_bytes={self.min_offload_bytes}", f"mb={self.microbatches}{self.backward_order}"]
        for name in ("marks", "checkpoint", "pack_below", "retain_graph", "raise_in_group", "inplace_after_save",
                     "delay", "use_wrap", "in_except", "same_names", "regions", "memory_budget", "twists", "order",
                     "wrap_dict", "deep", "chain", "resize"):
            value = getattr(self, name)
            if value not in (None, False, [], {}):
                opts.append(f"{name}={value}")
        if self.warmup != "offload":
            opts.append(f"warmup={self.warmup}")
        if self.checkpoint and self.checkpoint_kind != "nonreentrant":
            opts.append(f"checkpoint_kind={self.checkpoint_kind}")
        if self.steps != 1:
            opts.append(f"steps={self.steps}")
        return " ".join(opts)

    def positions(self) -> list[int]:
        """The group (block) run at each position (before the ``deep`` tiny ones)."""
        return list(range(len(self.groups))) if self.order is None else list(self.order)


def generate(seed: int, device: str = "cpu", themes: bool = True) -> Scenario:
    """Draw a scenario from ``seed`` (same seed, same scenario); ``themes=False``: without what
    users do (``P``), the scenario the seed gave before those were drawn."""
    rng = random.Random(seed)
    dtypes = ["float32", "bfloat16", "float16"] + (["float64"] if device == "cpu" else [])
    n_groups = rng.randint(1, 4)
    groups = [[rng.choice(LAYERS) for _ in range(rng.randint(1, 3))] for _ in range(n_groups)]
    names = [f"{g}.{i}" for g, layers in enumerate(groups) for i in range(len(layers))]
    marks = {n: m for n in names if (m := rng.choice(MARKS)) is not None and rng.random() < 0.5}
    mb = rng.choice([1, 1, 2, 3])
    order = list(range(mb))
    rng.shuffle(order)
    s = Scenario(
        seed=seed,
        device=device,
        dtype=rng.choice(dtypes),
        groups=groups,
        marks=marks,
        # PyTorch's checkpoint itself cannot save nested tensors
        checkpoint=[n for n in names if rng.random() < 0.1 and _layer(groups, n) != "nested"],
        policy=rng.choice(["all", "all", "all", "marked"]),
        keep_last=rng.choice([0, 0, 1, 1, 2]),
        prefetch=rng.choice([0, 1, 2]),
        max_inflight=rng.choice([0, 1, 2]),
        min_offload_bytes=rng.choice([0, 0, 0, 0, 512, 4096, 1 << 20]),
        pack_below=rng.choice([None, None, 0, 1 << 10]),
        use_wrap=rng.random() < 0.3,
        microbatches=mb,
        backward_order=order,
        retain_graph=rng.random() < 0.15,
        raise_in_group=rng.randrange(n_groups) if rng.random() < 0.1 else None,
        inplace_after_save=rng.choice(names) if rng.random() < 0.07 else None,
        delay=rng.choice(["d2h", "h2d", "compute"]) if device == "cuda" and rng.random() < 0.3 else None,
        in_except=rng.random() < 0.1,
        same_names=rng.random() < 0.15,
        width=rng.choice([16, 32]),
        seq=rng.choice([4, 8]),
        batch=rng.choice([1, 2]),
    )
    # drawn last, so the other fields of a seed stay what they were
    if s.use_wrap and rng.random() < 0.5 and not any(_NOT_RECOMPUTABLE & set(layers) for layers in groups):
        s.warmup = "recompute"
    if themes:
        _draw_what_users_do(s, rng)  # drawn last, as above
    return s


def _draw_what_users_do(s: Scenario, rng: random.Random) -> None:
    """What users do, each theme with its own probability (``P``)."""
    n = len(s.groups)
    recomputable = not any(_NOT_RECOMPUTABLE & set(layers) for layers in s.groups)
    # one module at several positions: the whole stack tied across depth, or one block repeated
    if rng.random() < P["shared"]:
        k = rng.randint(2, 3)
        if rng.random() < 0.5:
            s.order = list(range(n)) * k
        else:
            order, b = list(range(n)), rng.randrange(n)
            for _ in range(k - 1):
                order.insert(rng.randint(0, len(order)), b)
            s.order = order
    if s.use_wrap and rng.random() < P["wrap_dict"]:
        s.wrap_dict = True
    # checkpointing: inside a group of another kind, and regions around groups
    if s.checkpoint and rng.random() < P["checkpoint_kind"]:
        s.checkpoint_kind = rng.choice(CHECKPOINT_KINDS[1:])
    if rng.random() < P["region"]:
        positions = s.positions()
        nested = [p for p, g in enumerate(positions) if "nested" in s.groups[g]]  # checkpoint cannot save them
        start = 0
        for _ in range(rng.randint(1, 2)):
            free = [p for p in range(start, len(positions)) if p not in nested]
            if not free:
                break
            first = rng.choice(free)
            last = first
            while last + 1 < len(positions) and last + 1 not in nested and last - first < 2 and rng.random() < 0.5:
                last += 1
            s.regions.append({"first": first, "last": last, "kind": rng.choice(CHECKPOINT_KINDS),
                              "outside": rng.random() < 0.5})
            start = last + 1
    # recomputation the library chooses, over several steps
    if rng.random() < P["budget"]:
        s.memory_budget = rng.choice(["huge", "huge", "small", "small", "mid"])
        s.warmup = "offload"  # a budget's first steps recompute already (recompute is refused with it)
        s.use_wrap = recomputable and rng.random() < 0.85
        s.wrap_dict = s.wrap_dict and s.use_wrap
        s.steps = rng.choice([3, 3, 4])
    elif s.warmup == "recompute":
        s.steps = rng.choice([1, 2])
    library_recomputes = s.memory_budget is not None or (s.warmup == "recompute" and s.use_wrap)
    for twist in TWISTS:
        if rng.random() < (P["twist_recomputing"] if library_recomputes else P["twist"]):
            if twist == "functional_call" and any({"compiled", "parameter_swap"} & set(g) for g in s.groups):
                continue  # torch.compile guards on the module's own parameters
            s.twists.append(twist)
            if twist in ("eval", "attribute"):  # a layer that reads what changes
                s.groups[rng.randrange(n)].append("dropout" if twist == "eval" else "attribute")
    # deep graphs
    if rng.random() < P["deep"]:  # (at most 2000 tiny groups a step: seconds each)
        s.deep = rng.choice([d for d in (500, 1000, 2000) if d * s.microbatches * s.steps <= 2000] or [500])
    if rng.random() < P["chain"]:
        s.chain = rng.choice([200, 1000])
        s.groups[rng.randrange(n)].append("chain")
    # storages freed after forward and refilled before backward
    in_region = {s.positions()[p] for r in s.regions for p in range(r["first"], r["last"] + 1)}
    hosts = [g for g in range(n) if g not in in_region]
    if hosts and rng.random() < P["resize"]:
        s.resize = rng.choice(["after_group", "after_forward"])
        s.groups[rng.choice(hosts)].append("resizable")


# How often each theme is drawn (per scenario): every theme shows in a few hundred seeds.
P = {
    "shared": 0.10,  # order: a block at several positions
    "wrap_dict": 0.25,  # of the wrapped scenarios: an nn.ModuleDict given to ao.wrap
    "checkpoint_kind": 0.5,  # of the scenarios with layers checkpointed in a group: reentrant or selective
    "region": 0.15,  # checkpoint regions around one to three positions
    "budget": 0.08,  # a memory budget (huge 2/5, small 2/5, mid 1/5), 3 or 4 steps
    "twist_recomputing": 0.3,  # each twist, where the library recomputes (warm-up or budget)
    "twist": 0.04,  # each twist, elsewhere
    "deep": 0.015,  # 500, 1000 or 2000 tiny groups (seconds each: the rarest)
    "chain": 0.04,  # a layer with a chain of 200 or 1000 ops
    "resize": 0.06,  # a layer whose saved tensor's storage is freed and refilled
}


def themes(s: Scenario) -> list[str]:
    """What ``s`` exercises beyond one plain step (for counting failures by theme)."""
    out = []
    if s.checkpoint:
        out.append(f"checkpoint_in_group:{s.checkpoint_kind}")
    out += sorted({f"region:{r['kind']}" for r in s.regions})
    if any(r["outside"] for r in s.regions):
        out.append("region:saves_outside_groups")
    if s.memory_budget is not None:
        out.append(f"budget:{s.memory_budget}")
    if s.warmup == "recompute" and s.use_wrap:
        out.append("warmup_recompute")
    out += [f"twist:{t}" for t in s.twists]
    if s.order is not None and len(set(s.order)) < len(s.order):
        out.append("shared_modules")
    if s.wrap_dict and s.use_wrap:
        out.append("module_dict")
    if s.deep:
        out.append("deep_groups")
    if s.chain and any("chain" in g for g in s.groups):
        out.append("long_chain")
    if s.resize and any("resizable" in g for g in s.groups):
        out.append(f"resize:{s.resize}")
    return out


def _layer(groups: list[list[str]], name: str) -> str:
    g, i = map(int, name.split("."))
    return groups[g][i]


def shrinks(s: Scenario) -> list[Scenario]:
    """Smaller variants of ``s``, most promising first (for reducing a failure)."""
    out: list[Scenario] = []
    for g in range(len(s.groups)):  # drop a whole group
        if len(s.groups) > 1:
            out.append(_without_group(s, g))
    for g, layers in enumerate(s.groups):  # drop one layer
        for i in range(len(layers)):
            if len(layers) > 1:
                out.append(_without_layer(s, g, i))
    if s.deep > 1:  # fewer tiny groups first: a failure with many often shows with a few
        out += [replace(s, deep=d) for d in (1, s.deep // 8, s.deep // 2) if 0 < d < s.deep]
    if s.chain > 2:
        out += [replace(s, chain=c) for c in (2, s.chain // 8) if 1 < c < s.chain]
    positions = s.positions()
    if len(positions) > 1 and s.order is not None:  # drop a position
        for p in range(len(positions)):
            out.append(_keep_positions(s, [q for q in range(len(positions)) if q != p]))
    if s.microbatches > 1:
        out.append(replace(s, microbatches=1, backward_order=[0], retain_graph=s.retain_graph))
    if s.memory_budget is not None:
        if s.steps > 3:
            out.append(replace(s, steps=3))
        if s.memory_budget == "mid":
            out.append(replace(s, memory_budget="small"))
        out.append(replace(s, memory_budget=None, steps=1))
    elif s.steps > 1:
        out.append(replace(s, steps=s.steps - 1))
    for name, plain in (("retain_graph", False), ("raise_in_group", None), ("inplace_after_save", None),
                        ("checkpoint", []), ("marks", {}), ("delay", None), ("use_wrap", False),
                        ("pack_below", None), ("policy", "all"), ("in_except", False), ("same_names", False),
                        ("warmup", "offload"), ("regions", []), ("twists", []), ("order", None),
                        ("wrap_dict", False), ("deep", 0), ("resize", None), ("checkpoint_kind", "nonreentrant")):
        if getattr(s, name) != plain:
            out.append(replace(s, **{name: plain}))
    if len(s.regions) > 1:
        out += [replace(s, regions=[r for r in s.regions if r is not drop]) for drop in s.regions]
    out += [replace(s, regions=[dict(r, outside=False) if r is o else r for r in s.regions])
            for o in s.regions if o["outside"]]
    if len(s.twists) > 1:
        out += [replace(s, twists=[t for t in s.twists if t != drop]) for drop in s.twists]
    for key in s.marks:
        out.append(replace(s, marks={k: v for k, v in s.marks.items() if k != key}))
    return out


def _without_group(s: Scenario, drop: int) -> Scenario:
    def move(name: str) -> str | None:
        g, i = map(int, name.split("."))
        return None if g == drop else f"{g - (g > drop)}.{i}"

    groups = [layers for g, layers in enumerate(s.groups) if g != drop]
    kept = [p for p, g in enumerate(s.positions()) if g != drop]
    smaller = _keep_positions(s, kept)  # positions first (by the old group numbers), then the groups
    order = None if s.order is None else [g - (g > drop) for g in smaller.positions()]
    return _remap(replace(smaller, order=order), groups, move, smaller.raise_in_group)


def _keep_positions(s: Scenario, kept: list[int]) -> Scenario:
    """``s`` with only the positions ``kept`` (in order, given as ``order``); regions and the
    failing position follow."""
    new = {p: k for k, p in enumerate(kept)}
    regions = []
    for r in s.regions:
        inside = [new[p] for p in range(r["first"], r["last"] + 1) if p in new]
        if inside:
            regions.append(dict(r, first=inside[0], last=inside[-1]))
    return replace(s, order=[s.positions()[p] for p in kept], regions=regions,
                   raise_in_group=new.get(s.raise_in_group) if s.raise_in_group is not None else None)


def _without_layer(s: Scenario, group: int, drop: int) -> Scenario:
    def move(name: str) -> str | None:
        g, i = map(int, name.split("."))
        if g != group:
            return name
        return None if i == drop else f"{g}.{i - (i > drop)}"

    groups = [list(layers) for layers in s.groups]
    del groups[group][drop]
    return _remap(s, groups, move, s.raise_in_group)


def _remap(s: Scenario, groups, move, raise_in_group) -> Scenario:
    marks = {m: v for k, v in s.marks.items() if (m := move(k)) is not None}
    checkpoint = [m for k in s.checkpoint if (m := move(k)) is not None]
    inplace = move(s.inplace_after_save) if s.inplace_after_save else None
    return replace(s, groups=groups, marks=marks, checkpoint=checkpoint, inplace_after_save=inplace,
                   raise_in_group=raise_in_group)
