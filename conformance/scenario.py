"""Seeded, printable training scenarios for differential testing.

A :class:`Scenario` is plain data (JSON-serializable): the layers of each group, the
offloader options, micro-batches, and what happens around them (marks, retain_graph,
checkpointing, an exception, an in-place write after a save, a delayed stream).
:func:`generate` draws one from a seed; :func:`shrinks` lists smaller variants, so a
failure can be reduced to a minimal reproduction.
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
                     "delay", "use_wrap", "in_except", "same_names"):
            value = getattr(self, name)
            if value not in (None, False, [], {}):
                opts.append(f"{name}={value}")
        if self.warmup != "offload":
            opts.append(f"warmup={self.warmup}")
        return " ".join(opts)


def generate(seed: int, device: str = "cpu") -> Scenario:
    """Draw a scenario from ``seed`` (same seed, same scenario)."""
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
    return s


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
    if s.microbatches > 1:
        out.append(replace(s, microbatches=1, backward_order=[0], retain_graph=s.retain_graph))
    for name, plain in (("retain_graph", False), ("raise_in_group", None), ("inplace_after_save", None),
                        ("checkpoint", []), ("marks", {}), ("delay", None), ("use_wrap", False),
                        ("pack_below", None), ("policy", "all"), ("in_except", False), ("same_names", False),
                        ("warmup", "offload")):
        if getattr(s, name) != plain:
            out.append(replace(s, **{name: plain}))
    for key in s.marks:
        out.append(replace(s, marks={k: v for k, v in s.marks.items() if k != key}))
    return out


def _without_group(s: Scenario, drop: int) -> Scenario:
    def move(name: str) -> str | None:
        g, i = map(int, name.split("."))
        return None if g == drop else f"{g - (g > drop)}.{i}"

    return _remap(s, [layers for g, layers in enumerate(s.groups) if g != drop], move,
                  None if s.raise_in_group in (None, drop) else s.raise_in_group - (s.raise_in_group > drop))


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
