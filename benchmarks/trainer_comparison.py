"""How people offload activations in Hugging Face ``Trainer``, side by side in one run on one GPU.

A random-init ``LlamaForCausalLM`` (from a config, nothing downloaded: d2048, 8 layers, 16 heads
/ 4 KV heads, MLP 5632, vocab 32000, bf16 weights, eager attention) trains 4 sequences of 2048
random tokens a step with ``Trainer`` (AdamW, ``adamw_torch``, lr 1e-4 constant, no saving, no
reports, fixed seeds, deterministic algorithms) under each method:

- ``none``: neither checkpointing nor offloading (``none_repeat``: the same again, last, for the
  run-to-run check: its losses must equal ``none``'s bit for bit, and its step time shows drift);
- ``hf_checkpointing``: ``activation_checkpointing=True`` (``gradient_checkpointing`` before
  transformers 5.2x), non-reentrant;
- ``hf_checkpointing_offload``: the same with ``{"offload": True}`` in its kwargs: transformers
  holds what each checkpoint saves (the layer's inputs) in pinned host memory
  (``torch.autograd.graph.save_on_cpu``); "unsupported" where the installed transformers has no
  such option or would pass it to ``torch.utils.checkpoint``;
- ``trl_activation_offloading``: TRL's ``get_act_offloading_ctx_manager(model)`` entered around
  each ``training_step``, as TRL's SFT trainer does with ``activation_offloading=True``;
  ``trl_activation_offloading_checkpointing``: that with checkpointing, SFTConfig's default;
  only ``trl.models.activation_offloading`` is imported (no ``datasets``);
- ``actoffload_checkpointing``: ``ActivationOffloadCallback()`` with checkpointing: each layer's
  checkpoint inputs go to host memory (what the two above do, by actoffload);
- ``actoffload_budget``: ``ActivationOffloadCallback(memory_budget=B)``, B the peak *reserved*
  memory of ``hf_checkpointing`` measured in this run (so that runs first); ``_1.25x``: 1.25 B.

For each: median step time of the steps after the first 4 (each optimizer step timed from
``on_step_begin`` to ``on_step_end`` with ``torch.cuda.synchronize``), peak reserved and
allocated device memory over training (the maximum of readings at each step's end: actoffload's
budget resets the peak counters when a step's first layer opens), peak pinned host memory
(torch's host allocator, which all methods use), peak RSS of the process, the per-step losses
and whether they equal ``none``'s bit for bit, and a digest of the final weights.

Each method runs in a fresh subprocess of its own on CUDA (``--isolation subprocess``, the
default there): each starts from an empty caching allocator, an empty pinned-host cache and no
hooks or global state left by another method, so its reserved-memory, pinned and RSS figures are
its own. (In one process, blocks the allocator reserved for one method's sizes stay mapped until
``empty_cache``, and pinned host memory stays cached, which skews the next method's figures.)
``--small`` (a tiny model, on the CPU) runs in this process by default: it is for testing every
code path, and a fresh interpreter per method costs more than its training there.

    python -m benchmarks.trainer_comparison --out results.json          # on a GPU, a few minutes
    python benchmarks/trainer_comparison.py --small --out small.json    # on the CPU, seconds

On the CPU, transformers' offload (it pins host memory) and TRL's (it needs
``torch.accelerator``) cannot run: they are recorded "unavailable" with the reason; so is every
method whose library is not installed. ``--methods`` picks and orders methods (``hf_checkpointing``
moves ahead of the others, after ``none``); ``--budget`` gives B instead of measuring it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import hashlib
import importlib.util
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python benchmarks/trainer_comparison.py` from a checkout
    sys.path.insert(0, str(ROOT))

# before transformers is imported: nothing from the hub, no telemetry
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

GiB = 2**30

FULL = dict(hidden=2048, layers=8, heads=16, kv_heads=4, intermediate=5632, vocab=32000, batch=4, seq=2048,
            steps=12, skip=4, lr=1e-4, seed=0)
SMALL = dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=176, vocab=512, batch=2, seq=64,
             steps=4, skip=2, lr=1e-4, seed=0)

# name -> how it trains: checkpointing kwargs (None: off), TRL's context, actoffload's callback
METHODS: dict[str, dict[str, Any]] = {
    "none": {},
    "hf_checkpointing": {"checkpointing": {"use_reentrant": False}},
    "hf_checkpointing_offload": {"checkpointing": {"use_reentrant": False, "offload": True}},
    "trl_activation_offloading": {"trl": True},
    "trl_activation_offloading_checkpointing": {"trl": True, "checkpointing": {"use_reentrant": False}},
    "actoffload_checkpointing": {"actoffload": {}, "checkpointing": {"use_reentrant": False}},
    "actoffload_budget": {"actoffload": {"budget_factor": 1.0}},
    "actoffload_budget_1.25x": {"actoffload": {"budget_factor": 1.25}},
    "none_repeat": {},
}
REFERENCE = "hf_checkpointing"  # the ratios' denominator, and the budgets' measure
# On the CPU a budget bounds the bytes the layers save (docs/budgets.md): --small's two layers
# save about 1.1 MiB a step, and the least a plan holds is about half that; 1 MiB makes a plan
# move or recompute something.
CPU_BUDGET = 2**20


class Unsupported(Exception):
    """The method cannot run with the installed libraries (status ``unsupported``)."""


class Unavailable(Exception):
    """A library the method needs is missing or cannot run here (status ``unavailable``)."""


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / GiB:.2f} GiB" if n >= GiB / 4 else f"{n / 2**20:.2f} MiB"


def _tail(text: str, n: int = 3000) -> str:
    return text if len(text) <= n else "..." + text[-n:]


# ---------------------------------------------------------------------------------------------
# One method's training (in this process or in a worker subprocess)
# ---------------------------------------------------------------------------------------------

def _model(cfg: dict, device: Any) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"],
                         num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                         num_key_value_heads=cfg["kv_heads"], vocab_size=cfg["vocab"],
                         max_position_embeddings=cfg["seq"], pad_token_id=0, bos_token_id=None, eos_token_id=1,
                         use_cache=False, attn_implementation="eager")
    torch.manual_seed(cfg["seed"])
    with torch.device(device):  # random init where it trains: the same weights in every run
        model = LlamaForCausalLM(config)
    return model.to(torch.bfloat16)


def _dataset(cfg: dict) -> Any:
    import torch

    class Tokens(torch.utils.data.Dataset):
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(cfg["seed"])
            self.ids = torch.randint(2, cfg["vocab"], (cfg["batch"] * cfg["steps"], cfg["seq"]), generator=g)

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    return Tokens()


def _trl_context(model: Any) -> Any:
    """TRL's activation-offloading context for ``model``, as its SFT trainer makes it."""
    try:
        from trl.models.activation_offloading import get_act_offloading_ctx_manager
    except Exception as e:  # ImportError, or TRL's own import-time checks
        raise Unavailable(f"trl.models.activation_offloading does not import: {type(e).__name__}: {e}") from e
    try:
        return get_act_offloading_ctx_manager(model=model)
    except Exception as e:  # on a CPU-only machine: torch.accelerator.current_accelerator() is None
        import torch
        why = "" if torch.cuda.is_available() else " (it needs an accelerator: torch.accelerator.current_accelerator() is None)"
        raise Unavailable(f"TRL's get_act_offloading_ctx_manager fails here{why}: {type(e).__name__}: {e}") from e


def _checkpoint_check(model: Any, kwargs: dict) -> dict:
    """What transformers set up as each layer's checkpoint: whether ``offload`` took effect."""
    import functools

    import torch
    import torch.utils.checkpoint
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer as Layer
    except ImportError:  # older transformers: every module with the flag
        Layer = torch.nn.Module
    layers = [m for m in model.modules() if isinstance(m, Layer) and getattr(m, "gradient_checkpointing", False)
              and hasattr(m, "_gradient_checkpointing_func")]
    info: dict[str, Any] = {"checkpointed_layers": len(layers)}
    if not layers:
        raise RuntimeError("checkpointing was asked for, but no layer of the model is checkpointed")
    func = layers[0]._gradient_checkpointing_func
    keywords = dict(func.keywords) if isinstance(func, functools.partial) else {}
    inner = func.func if isinstance(func, functools.partial) else func
    info["checkpoint_function"] = getattr(inner, "__qualname__", repr(inner))
    info["checkpoint_kwargs"] = {k: v for k, v in keywords.items() if isinstance(v, (bool, int, float, str))}
    if kwargs.get("offload"):
        if "offload" in keywords:
            raise Unsupported("this transformers passes `offload` on to torch.utils.checkpoint.checkpoint, "
                              "which does not take it")
        if inner is torch.utils.checkpoint.checkpoint:
            raise Unsupported("this transformers ignores `offload`: the layers' checkpoint is plain "
                              "torch.utils.checkpoint.checkpoint")
    return info


def run_method(method: str, cfg: dict, budget: int | None = None) -> dict:
    """Train ``cfg``'s model under ``method``; what it measured, as JSON-able figures (status
    ``ok``, ``unsupported``, ``unavailable``, ``skipped`` or ``error``, with a ``reason``)."""
    try:
        return _run_method(method, cfg, budget)
    except ImportError as e:
        if importlib.util.find_spec("transformers") is None:
            return {"method": method, "status": "unavailable", "reason": "transformers is not installed"}
        return {"method": method, "status": "error", "reason": f"{type(e).__name__}: {e}",
                "traceback": _tail(traceback.format_exc())}
    except Exception as e:  # before training's own handling
        return {"method": method, "status": "error", "reason": f"{type(e).__name__}: {e}",
                "traceback": _tail(traceback.format_exc())}


def _run_method(method: str, cfg: dict, budget: int | None) -> dict:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    spec = METHODS[method]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    res: dict[str, Any] = {"method": method, "status": "ok"}
    ckpt = spec.get("checkpointing")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    # refusals that need no model
    if ckpt and ckpt.get("offload"):
        from transformers import PreTrainedModel
        import inspect
        enable = getattr(PreTrainedModel, "activation_checkpointing_enable", None) or \
            PreTrainedModel.gradient_checkpointing_enable
        if "offload" not in inspect.signature(enable).parameters:
            res.update(status="unsupported", reason=f"transformers {_version('transformers')}: "
                       f"{enable.__name__} takes no `offload`")
            return res
    ao_settings: dict[str, Any] | None = None
    if "actoffload" in spec:
        ao_settings = {}
        if "budget_factor" in spec["actoffload"]:
            if budget is None:
                res.update(status="skipped", reason=f"no budget: {REFERENCE} did not run or measured nothing")
                return res
            ao_settings["memory_budget"] = int(budget * spec["actoffload"]["budget_factor"])
            res["memory_budget_bytes"] = ao_settings["memory_budget"]
        if not cuda:  # the tiny model's tensors are far under the 1 MiB default: offload them anyway
            ao_settings["min_offload_bytes"] = 0

    from transformers import logging as hf_logging
    hf_logging.set_verbosity_error()

    model = trainer = None
    times: list[float] = []
    peaks = {"allocated": 0, "reserved": 0}
    plan_states: list[Any] = []
    losses: list[Any] = []
    callbacks: list[Any] = []
    offload_cb = None
    out_dir = tempfile.mkdtemp(prefix="trainer-comparison-")  # Trainer's output_dir: nothing is saved there
    try:
        from actoffload.integrations.transformers import ActivationOffloadCallback

        def read_peaks() -> None:
            if cuda:
                peaks["allocated"] = max(peaks["allocated"], torch.cuda.max_memory_allocated())
                peaks["reserved"] = max(peaks["reserved"], torch.cuda.max_memory_reserved())

        class StepBegin(TrainerCallback):
            t0 = 0.0

            def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                sync()
                StepBegin.t0 = time.perf_counter()

        class StepEnd(TrainerCallback):  # after every other callback's on_step_end
            def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
                if ckpt:
                    res.update(_checkpoint_check(model, ckpt))

            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                sync()
                times.append(time.perf_counter() - StepBegin.t0)
                read_peaks()
                if offload_cb is not None and offload_cb.offloader is not None:
                    plan = offload_cb.offloader.stats().get("plan")
                    plan_states.append(None if plan is None else plan.get("state"))

        class Recording(Trainer):
            offload_context: Any = None

            def training_step(self, *args: Any, **kwargs: Any) -> Any:
                with self.offload_context if self.offload_context is not None else contextlib.nullcontext():
                    loss = super().training_step(*args, **kwargs)
                losses.append(loss.detach())
                return loss

        if ao_settings is not None:
            offload_cb = ActivationOffloadCallback(**ao_settings)
            callbacks.append(offload_cb)

        names = {f.name for f in dataclasses.fields(TrainingArguments)}
        ckpt_name = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
        targs: dict[str, Any] = dict(
            output_dir=out_dir, max_steps=cfg["steps"],
            per_device_train_batch_size=cfg["batch"], gradient_accumulation_steps=1, learning_rate=cfg["lr"],
            lr_scheduler_type="constant", optim="adamw_torch", bf16=False, seed=cfg["seed"], data_seed=cfg["seed"],
            report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True,
            dataloader_num_workers=0, use_cpu=not cuda)
        if ckpt:
            targs[ckpt_name] = True
            targs[ckpt_name + "_kwargs"] = dict(ckpt)
            res["checkpointing_argument"] = ckpt_name
        args = TrainingArguments(**targs)

        model = _model(cfg, device)
        trainer = Recording(model=model, args=args, train_dataset=_dataset(cfg),
                            callbacks=[StepBegin(), *callbacks, StepEnd()])
        from transformers import PrinterCallback
        trainer.remove_callback(PrinterCallback)  # it prints the final train metrics, nothing we use
        if spec.get("trl"):
            trainer.offload_context = _trl_context(trainer.model)
            res["trl"] = _version("trl")

        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            reset_host = getattr(torch.cuda, "reset_peak_host_memory_stats", None)
            if reset_host is not None:  # matters in one process only: a worker starts with none pinned
                reset_host()
            res["allocated_at_start_bytes"] = torch.cuda.memory_allocated()
        try:
            trainer.train()
        except Unsupported:
            raise
        except Exception as e:
            if ckpt and ckpt.get("offload") and "offload" in str(e):
                raise Unsupported(f"{type(e).__name__}: {e}") from e
            if not cuda and "pin_memory" in str(e):  # save_on_cpu(pin_memory=True) on a CPU-only machine
                raise Unavailable(f"it pins host memory, which needs an accelerator: {type(e).__name__}: {e}") from e
            raise
        sync()
        read_peaks()

        res["losses"] = [float(x) for x in torch.stack(losses).float().cpu()]
        res["step_s"] = times
        timed = times[cfg["skip"]:]
        res["median_step_s"] = statistics.median(timed) if timed else None
        res["timed_steps"] = len(timed)
        if cuda:
            res["peak_allocated_bytes"] = peaks["allocated"]
            res["peak_reserved_bytes"] = peaks["reserved"]
            try:  # torch's pinned host allocator: TRL, save_on_cpu and actoffload all allocate there
                res["pinned_host_peak_bytes"] = torch.cuda.host_memory_stats().get("allocated_bytes.peak")
            except Exception:  # an older torch
                res["pinned_host_peak_bytes"] = None
        digest = hashlib.sha256()
        for p in trainer.model.parameters():
            digest.update(p.detach().to("cpu").contiguous().view(torch.uint8).numpy())
        res["weights_sha256"] = digest.hexdigest()
        if offload_cb is not None and offload_cb.offloader is not None:
            stats = offload_cb.offloader.stats()
            res["actoffload"] = {"impl": offload_cb.offloader.impl,
                                 "offloaded_bytes_last_step": stats.get("offloaded_bytes")}
            plan = stats.get("plan")
            if plan:
                res["actoffload"]["plan_state_per_step"] = plan_states
                res["actoffload"]["timed_steps_all_settled"] = all(
                    st == "settled" for st in plan_states[cfg["skip"]:])
                res["actoffload"]["plan"] = {k: plan.get(k) for k in (
                    "memory_budget", "state", "settled", "predicted_peak_bytes", "predicted_step_s",
                    "measured_peak_bytes", "smallest_reachable_bytes", "plans_tried")}
                res["actoffload"]["plan"]["actions"] = [g.get("action") for g in plan.get("groups", [])]
    except Unsupported as e:
        res.update(status="unsupported", reason=str(e))
    except Unavailable as e:
        res.update(status="unavailable", reason=str(e))
    except Exception as e:
        res.update(status="error", reason=f"{type(e).__name__}: {e}", traceback=_tail(traceback.format_exc()))
    finally:
        res["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if offload_cb is not None and offload_cb.handle is not None:
            offload_cb.handle.remove()
        del trainer, model, callbacks, offload_cb, losses
        shutil.rmtree(out_dir, ignore_errors=True)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return res


# ---------------------------------------------------------------------------------------------
# The comparison
# ---------------------------------------------------------------------------------------------

def _run_subprocess(method: str, cfg: dict, budget: int | None, timeout: float, fill: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="trainer-comparison-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", method, "--worker-config",
               json.dumps({"cfg": cfg, "budget": budget, "fill": fill}), "--worker-out", str(out)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            output = (e.stdout or b"") + (e.stderr or b"") if isinstance(e.stdout, bytes) else \
                (e.stdout or "") + (e.stderr or "")
            return {"method": method, "status": "error", "reason": f"timed out after {timeout:.0f} s",
                    "output_tail": _tail(output if isinstance(output, str) else output.decode(errors="replace"))}
        if out.exists():
            res = json.loads(out.read_text())
        else:
            res = {"method": method, "status": "error", "reason": f"worker exited {proc.returncode} with no result"}
        if res.get("status") == "error" or proc.returncode != 0:
            res["output_tail"] = _tail(proc.stdout + proc.stderr)
        return res


def _fill_uninitialized(on: bool | None) -> bool:
    """Deterministic mode fills what ``torch.empty`` returns with NaN by default; the bitwise
    comparisons need only the deterministic kernels, and the fill would time a memset of every
    buffer an offloader takes from ``torch.empty`` (TRL's and save_on_cpu's host copies, each
    step), which no one training pays. Off unless ``--fill-uninitialized-memory``. Returns the
    setting now in force; ``on=None`` only reads it."""
    try:
        import torch.utils.deterministic as flags
    except ImportError:  # a torch without the setting: it always fills
        return True
    if not hasattr(flags, "fill_uninitialized_memory"):
        return True
    if on is not None:
        flags.fill_uninitialized_memory = on
    return bool(flags.fill_uninitialized_memory)


def _describe(cuda: bool) -> dict:
    import torch

    from actoffload.tools.provenance import describe
    env = describe(torch.device("cuda" if cuda else "cpu"))
    for name in ("transformers", "trl", "accelerate", "actoffload"):
        env[name] = _version(name)
    env["deterministic"] = torch.are_deterministic_algorithms_enabled()
    env["CUBLAS_WORKSPACE_CONFIG"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    return env


def _compare(results: dict[str, dict]) -> None:
    """Bitwise comparisons with ``none`` and ratios to :data:`REFERENCE`, into each result."""
    ref = results.get("none", {})
    base = results.get(REFERENCE, {})
    for name, r in results.items():
        if r.get("status") != "ok":
            continue
        if ref.get("status") == "ok" and name != "none":
            a, b = ref["losses"], r["losses"]
            r["losses_equal_none"] = a == b
            r["max_abs_loss_diff_vs_none"] = max((abs(x - y) for x, y in zip(a, b)), default=None) \
                if len(a) == len(b) else None
            r["weights_equal_none"] = ref.get("weights_sha256") == r.get("weights_sha256")
        if base.get("status") == "ok":
            ratios = {}
            for key in ("median_step_s", "peak_reserved_bytes", "peak_allocated_bytes"):
                if r.get(key) and base.get(key):
                    ratios[key] = r[key] / base[key]
            r["vs_" + REFERENCE] = ratios


def _table(results: dict[str, dict]) -> str:
    def num(v: Any, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
        return "-" if v is None else fmt.format(v / scale)

    rows = [("method", "status", "step ms", f"x {REFERENCE}", "reserved GiB", "x", "alloc GiB", "pinned GiB",
             "losses==none", "max|dloss|", "weights==none")]
    for name, r in results.items():
        if r.get("status") != "ok":
            rows.append((name, r.get("status", "?"), *["-"] * 9))
            continue
        ratio = r.get("vs_" + REFERENCE, {})
        same = r.get("losses_equal_none")
        rows.append((name, "ok", num(r.get("median_step_s"), 1e-3, "{:.1f}"), num(ratio.get("median_step_s")),
                     num(r.get("peak_reserved_bytes"), GiB), num(ratio.get("peak_reserved_bytes")),
                     num(r.get("peak_allocated_bytes"), GiB), num(r.get("pinned_host_peak_bytes"), GiB),
                     "-" if same is None else ("yes" if same else "NO"),
                     num(r.get("max_abs_loss_diff_vs_none"), fmt="{:.3g}"),
                     "-" if r.get("weights_equal_none") is None else ("yes" if r["weights_equal_none"] else "NO")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    notes = [f"  {n}: {r['status']}: {r.get('reason')}" for n, r in results.items() if r.get("status") != "ok"]
    return "\n".join(lines + notes)


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="trainer-comparison.json", help="the results' JSON file")
    p.add_argument("--small", action="store_true", help="a tiny model, for the CPU: every code path, in seconds")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated, run in this order (default: all: {','.join(METHODS)})")
    p.add_argument("--steps", type=int, help="optimizer steps per method (default 12; --small 4)")
    p.add_argument("--skip", type=int, help="first steps left out of the median (default 4; --small 2)")
    p.add_argument("--budget", type=int, help=f"B in bytes, instead of {REFERENCE}'s measured peak reserved")
    p.add_argument("--isolation", choices=("auto", "subprocess", "inprocess"), default="auto",
                   help="a fresh process per method (auto: on CUDA, unless --small) or all in this one")
    p.add_argument("--fill-uninitialized-memory", action="store_true",
                   help="keep PyTorch's deterministic-mode filling of torch.empty (NaN) on: it times a memset of "
                        "every buffer an offloader allocates with torch.empty, host buffers too")
    p.add_argument("--worker-timeout", type=float, default=200.0, help="seconds, per method in a subprocess")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-config", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    methods = [m.strip() for m in a.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        p.error(f"unknown methods {unknown}; known: {', '.join(METHODS)}")

    import torch

    from actoffload.tools.determinism import use_deterministic
    deterministic = torch.are_deterministic_algorithms_enabled()
    fill_before = _fill_uninitialized(None)
    use_deterministic(True)  # before CUDA's first matmul: sets CUBLAS_WORKSPACE_CONFIG too
    try:
        if a.worker:  # one method, in a subprocess of a comparison
            given = json.loads(a.worker_config)
            _fill_uninitialized(given["fill"])
            res = run_method(a.worker, given["cfg"], given["budget"])
            res["env"] = _describe(torch.cuda.is_available())
            Path(a.worker_out).write_text(json.dumps(res))
            return None
        return _comparison(a, methods)
    finally:  # as they were, for a caller in this process (the tests)
        use_deterministic(deterministic)
        _fill_uninitialized(fill_before)
        if "transformers" in sys.modules:
            from transformers import logging as hf_logging
            hf_logging.set_verbosity_warning()


def _comparison(a: argparse.Namespace, methods: list[str]) -> dict:
    import torch
    fill = _fill_uninitialized(a.fill_uninitialized_memory)
    cuda = torch.cuda.is_available()  # no CUDA context in this process when the methods run in subprocesses
    cfg = dict(SMALL if a.small else FULL)
    if a.steps is not None:
        cfg["steps"] = a.steps
    if a.skip is not None:
        cfg["skip"] = a.skip
    if REFERENCE in methods:  # the budgets are measured on it
        methods.remove(REFERENCE)
        first = [m for m in methods if m.startswith("none") and m != "none_repeat"]
        methods = first + [REFERENCE] + [m for m in methods if m not in first]
    isolation = a.isolation if a.isolation != "auto" else ("subprocess" if cuda and not a.small else "inprocess")

    results: dict[str, dict] = {}
    budget = a.budget
    started = time.perf_counter()
    worker_env = None
    for m in methods:
        if not cuda and budget is None and m.startswith("actoffload_budget"):
            budget = CPU_BUDGET  # the CPU has no allocator to measure
        t = time.perf_counter()
        if isolation == "subprocess":
            res = _run_subprocess(m, cfg, budget, a.worker_timeout, a.fill_uninitialized_memory)
            worker_env = worker_env or res.pop("env", None)
            res.pop("env", None)
        else:
            res = run_method(m, cfg, budget)
        res["wall_s"] = time.perf_counter() - t
        results[m] = res
        if m == REFERENCE and a.budget is None and res.get("peak_reserved_bytes"):
            budget = res["peak_reserved_bytes"]
        shown = f"{res['median_step_s'] * 1e3:.1f} ms/step" if res.get("median_step_s") else res.get("reason", "")
        print(f"[{time.perf_counter() - started:6.1f} s] {m}: {res['status']} {shown}", flush=True)

    _compare(results)
    env = _describe(cuda) if isolation == "inprocess" or worker_env is None else worker_env
    env["isolation"] = isolation
    env["fill_uninitialized_memory"] = fill
    report = {
        "what": "activation offloading in Hugging Face Trainer, side by side (benchmarks/trainer_comparison.py)",
        "env": env,
        "config": {**cfg, "model": "LlamaForCausalLM, random init, bf16 weights, eager attention",
                   "trainer": "adamw_torch, constant lr, bf16=False on a bf16 model, gradient_accumulation_steps=1, "
                              "max_grad_norm 1.0, dataloader_num_workers=0",
                   "budget_bytes": budget, "budget_source": "--budget" if a.budget is not None else (
                       f"{REFERENCE}'s peak reserved" if cuda else f"fixed for the CPU, {CPU_BUDGET} bytes: no allocator figures there; "
                       "the budget bounds the bytes the layers save (docs/budgets.md)"),
                   "timing": f"median of the steps after the first {cfg['skip']}, on_step_begin..on_step_end, "
                             "synchronized",
                   "memory": "max over the steps' ends of torch.cuda.max_memory_{reserved,allocated}, reset before "
                             "train(); pinned: torch.cuda.host_memory_stats()['allocated_bytes.peak']; max_rss: "
                             "the process's (per method only with subprocess isolation)"},
        "none_vs_none_bitwise": (None if "losses_equal_none" not in results.get("none_repeat", {}) else
                                 results["none_repeat"]["losses_equal_none"]
                                 and results["none_repeat"]["weights_equal_none"]),
        "methods": results,
        "wall_s": time.perf_counter() - started,
    }
    from actoffload.tools.provenance import results_json

    Path(a.out).write_text(results_json(report))
    print(f"\n{env.get('gpu')}, torch {env.get('torch')}, transformers {env.get('transformers')}, "
          f"trl {env.get('trl')}, commit {env.get('commit')}; {isolation}; "
          f"B = {_size(budget)}; none vs none bitwise: {report['none_vs_none_bitwise']}")
    print(_table(results))
    print(f"wrote {a.out} ({report['wall_s']:.0f} s)")
    return report


if __name__ == "__main__":
    main()
