"""actoffload.integrations.lightning with the real Lightning on the CPU: a fit with the callback
is bitwise equal to the same fit without it, on one device in this process, and with the DDP
and FSDP2 (ModelParallelStrategy) strategies on two processes (gloo)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning", reason="the Lightning integration needs lightning (pip install -e '.[integrations]')")
EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "integrations"
sys.path.insert(0, str(EXAMPLES))

import lightning as L  # noqa: E402
import lightning_fit  # noqa: E402

from actoffload.integrations.lightning import ActivationOffload  # noqa: E402


def test_a_fit_with_the_callback_is_bitwise_and_leaves_the_module_plain():
    torch.use_deterministic_algorithms(True)
    plain = lightning_fit.fit([], 1, "auto")
    callback = ActivationOffload(min_offload_bytes=0)
    offloaded = lightning_fit.fit([callback], 1, "auto")
    assert all(torch.equal(plain[k], offloaded[k]) for k in plain)
    assert callback.handle is not None and callback.handle.names == ["blocks.0", "blocks.1", "blocks.2"]
    assert callback.offloader.stats()["groups"]["blocks.0"]["offloaded_bytes"] > 0
    assert not callback.handle.attached and type(callback.handle.modules[0]) is lightning_fit.Block


def test_layers_by_path_and_a_budget():
    torch.use_deterministic_algorithms(True)
    plain = lightning_fit.fit([], 1, "auto")
    callback = ActivationOffload(layers="blocks", memory_budget="1GiB", min_offload_bytes=0)
    offloaded = lightning_fit.fit([callback], 1, "auto")
    assert all(torch.equal(plain[k], offloaded[k]) for k in plain)
    assert callback.offloader.impl == "fast" and callback.offloader.stats()["plan"]["groups"]


class _SkipsBatches(lightning_fit.Model):
    """Skips every third batch after its forward: ``training_step`` returns ``None``, and
    Lightning runs no backward for it."""

    def training_step(self, batch, i):
        loss = super().training_step(batch, i)
        return None if i % 3 == 2 else loss


def test_batches_skipped_by_training_step_leave_the_budgets_plan_settled():
    """A batch whose ``training_step`` returns ``None`` is a forward let go without a backward
    pass: the next batch begins a step of its own on the plan it had (R8), which stays
    settled from the first step after profiling; bitwise."""
    torch.use_deterministic_algorithms(True)
    states = []

    class Watch(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, i):
            states.append(callback.offloader.stats()["plan"]["state"])

    def fit(callbacks):
        L.seed_everything(0, verbose=False)
        model = _SkipsBatches()
        trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, callbacks=callbacks, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            deterministic=True, limit_val_batches=0)
        trainer.fit(model, lightning_fit.data())
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    plain = fit([])
    callback = ActivationOffload(layers="blocks", memory_budget="1GiB", min_offload_bytes=0)
    offloaded = fit([callback, Watch()])
    assert all(torch.equal(plain[k], offloaded[k]) for k in plain)
    assert len(states) == 16 and states[2:] == ["settled"] * 14, states


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_and_fsdp2_on_two_processes_are_bitwise():
    """Both ranks start at once (Lightning's environment variables, as a launcher sets them),
    so that their imports overlap."""
    base = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLES.parent.parent), os.environ.get("PYTHONPATH", "")]),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "NODE_RANK": "0"}
    command = [sys.executable, str(EXAMPLES / "lightning_fit.py"), "--devices", "2", "--strategy", "ddp,fsdp2"]
    ranks = [subprocess.Popen(command, env={**base, "LOCAL_RANK": str(rank)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outs = []
    try:
        for p in ranks:
            outs.append(p.communicate(timeout=300))
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    for p, (stdout, stderr) in zip(ranks, outs):
        assert p.returncode == 0, stdout[-3000:] + stderr[-3000:]
    found = re.findall(r"rank (\d): (\w+) on 2 device\(s\).*?(\d+) bytes offloaded .*?bitwise equal: (True|False)",
                       "".join(stdout for stdout, _ in outs))
    assert sorted((rank, strategy) for rank, strategy, _, _ in found) == [
        ("0", "ddp"), ("0", "fsdp2"), ("1", "ddp"), ("1", "fsdp2")], outs
    assert all(int(moved) > 0 and same == "True" for _, _, moved, same in found), outs
