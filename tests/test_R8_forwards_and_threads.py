"""R2, R8: what a forward is to the offloader (stats, group identity, prefetch), and threads."""

import gc
import sys
import threading

import pytest
import torch
import torch.utils.checkpoint

import actoffload as ao
from helpers import IMPLS, assert_bitwise, grads_of, mlp_stack, off_for, reference_grads, run_groups, zero_grads


@pytest.mark.parametrize("impl", IMPLS)
def test_R8_wrapped_model_called_inside_an_except_block_still_offloads(impl):
    """A retry loop or fallback path calls the model while handling an unrelated exception."""
    model = mlp_stack(3, 32, "cpu")
    x = torch.randn(8, 32, requires_grad=True)
    expected = reference_grads(model, x)
    off = off_for(impl, "cpu", keep_last=1)
    with ao.wrap(model, off):
        try:
            raise KeyError("unrelated")
        except KeyError:
            assert sys.exc_info()[0] is KeyError
            y = model(x)
    s = off.stats()
    assert sorted(s["groups"]) == ["0", "1", "2"] and s["offloaded_bytes"] > 0
    y.sum().backward()
    assert_bitwise(grads_of(model, x), expected)


@pytest.mark.parametrize("impl", IMPLS)
def test_R8_a_module_called_twice_in_one_forward_is_two_groups(impl):
    """Weight sharing across depth: stats count both calls, and match the host memory held."""
    block = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU())
    x = torch.randn(16, 32, requires_grad=True)
    off = off_for(impl, "cpu", keep_last=0)
    with ao.wrap([block], off):  # one group (a Sequential itself would give one per layer)
        y = block(block(x * 1))
    s = off.stats()
    assert sorted(s["groups"]) == ["0", "0#2"]
    assert s["groups"]["0"]["offloaded_bytes"] == s["groups"]["0#2"]["offloaded_bytes"] > 0
    assert s["host_bytes_in_use"] >= s["offloaded_bytes"] > 0
    if impl == "ref":
        assert s["host_bytes_in_use"] == s["offloaded_bytes"]
    y.sum().backward()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("let_go", ["dropped", "backward_raised"])
def test_R8_a_module_called_twice_in_one_forward_let_go_without_backward_stays_two_groups(impl, let_go):
    """Its second call opens a group of the first one's name, as a forward run again would; but
    one forward's graph is let go whole, so both stay reported, whether stats() is read before
    the graph is let go or after (autograd's device thread may let it go a while after a
    ``backward()`` that raised returns)."""
    block = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU())
    off = off_for(impl, "cpu", keep_last=0)
    with ao.wrap([block], off):
        y = block(block(torch.randn(16, 32, requires_grad=True) * 1))
    y = y.sigmoid()
    y.mul_(1)  # written after sigmoid saved it: backward raises before reaching either group
    before = off.stats()["groups"]
    assert sorted(before) == ["0", "0#2"]
    if let_go == "backward_raised":
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
    del y
    gc.collect()
    assert off.stats()["groups"] == before


@pytest.mark.parametrize("impl", IMPLS)
def test_R8_forwards_with_gradients_and_no_backward_keep_a_bounded_window(impl):
    """``y = model(x)`` again and again, no backward (an evaluation with gradients on): each
    forward's groups are let go once the next has run, and leave the window then, not at the
    next backward pass (every other forward's "name#k" stayed: 3,000 after 2,000 forwards)."""
    model = mlp_stack(3, 8, "cpu")
    off = off_for(impl, "cpu", keep_last=1)
    for _ in range(200):
        y = run_groups(model, torch.randn(4, 8, requires_grad=True), off)
    assert len(off._window) <= 6
    assert len(off.stats()["groups"]) == 3  # the latest forward's
    y.sum().backward()


@pytest.mark.parametrize("impl", IMPLS)
def test_R8_stats_cover_the_forwards_since_backward_last_began(impl):
    model = mlp_stack(2, 32, "cpu")
    off = off_for(impl, "cpu", keep_last=0)
    a = run_groups(model, torch.randn(8, 32, requires_grad=True), off).sum()
    b = run_groups(model, torch.randn(8, 32, requires_grad=True), off).sum()  # a micro-batch
    assert sorted(off.stats()["groups"]) == ["0", "0#2", "1", "1#2"]
    a.backward()
    b.backward()
    run_groups(model, torch.randn(8, 32, requires_grad=True), off).sum().backward()  # the next step
    assert sorted(off.stats()["groups"]) == ["0", "1"]


@pytest.mark.parametrize("impl", IMPLS)
def test_R8_a_forward_discarded_after_it_ran_again_leaves_the_window(impl):
    """``out = model(x); out = model(x)`` (an evaluation forward with gradients, run again): the
    first graph is let go only after the second forward named its groups ``name#2``; from then
    on the first's groups are not reported, and ``offloaded_bytes`` is what host memory holds."""
    model = mlp_stack(3, 32, "cpu")
    off = off_for(impl, "cpu", keep_last=1)
    run_groups(model, torch.randn(8, 32, requires_grad=True), off).sum().backward()
    y = run_groups(model, torch.randn(8, 32, requires_grad=True), off)
    y = run_groups(model, torch.randn(8, 32, requires_grad=True), off)
    gc.collect()
    s = off.stats()
    assert list(s["groups"]) == ["0#2", "1#2", "2#2"]
    assert s["offloaded_bytes"] == s["host_bytes_in_use"] > 0
    y = run_groups(model, torch.randn(8, 32, requires_grad=True), off)  # a third: the first's names, given up
    gc.collect()
    s = off.stats()
    assert sorted(s["groups"]) == ["0", "1", "2"] and s["offloaded_bytes"] == s["host_bytes_in_use"]
    y.sum().backward()
    assert sorted(off.stats()["groups"]) == ["0", "1", "2"]  # backward began: reported as they ran
    # names given with a "#" (the next step's): told apart by when they opened, not by their numbers
    with off.group("x#2"):
        y = model[0](torch.randn(8, 32, requires_grad=True) * 1)
    with off.group("x#2"):
        y = model[0](torch.randn(8, 32, requires_grad=True) * 1)
    gc.collect()
    s = off.stats()
    assert list(s["groups"]) == ["x#2#2"] and s["offloaded_bytes"] == s["host_bytes_in_use"], s["groups"]


class _CountsSteps(ao.Plan):
    """Counts the steps begun and the forwards cut short. ``hooks``: the groups it hooks,
    ``"every"``, ``"first"`` (a memory budget's plan keeping everything: only its first group,
    which tells the step's backward pass) or ``"none"``."""

    def __init__(self, hooks: str):
        super().__init__()
        self.hooks, self.begun, self.cut_short, self._first = hooks, 0, 0, True

    def step_begins(self) -> None:
        self.begun += 1
        self._first = True

    def forward_cut_short(self) -> None:
        self.cut_short += 1

    def opening(self, name, recomputable, parts):
        first, self._first = self._first, False
        if self.hooks == "every":
            return ao.plans.OFFLOAD
        return ao.Opening(keep_all=True) if self.hooks == "first" and first else ao.Opening(hooked=False)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("hooks", ["every", "first"])
def test_R8_a_forward_let_go_without_a_backward_pass_ends_its_step(impl, hooks):
    """A batch skipped after its forward (``del loss``), or an evaluation with gradients on whose
    loss was read and dropped: the next forward begins a step of its own, cut short as after an
    exception, whether the plan hooks every group or keeps everything, hooking only its first
    (a memory budget's plan: its hooks tell the step's backward pass). Forwards whose graphs
    live on (micro-batches whose backward is to come, several forwards then one backward) stay
    one step."""
    model, expected = mlp_stack(3, 32, "cpu"), mlp_stack(3, 32, "cpu")
    plan = _CountsSteps(hooks)
    off = ao.Offloader(impl=impl, device="cpu", plan=plan, min_offload_bytes=0)
    x = torch.randn(8, 32, requires_grad=True)
    with ao.wrap(model, off):
        model(x).sum().backward()
        assert (plan.begun, plan.cut_short) == (1, 0)
        loss = model(x).sum()  # skipped
        del loss
        loss = model(x).sum()
        assert (plan.begun, plan.cut_short) == (3, 1)
        loss.backward()
        a, b = model(x).sum(), model(x).sum()  # several forwards, then their backwards
        assert (plan.begun, plan.cut_short) == (4, 1)
        a.backward()
        b.backward()
        zero_grads(model, x)
        model(x).square().sum().backward()
    expected(x).square().sum().backward()
    assert_bitwise(grads_of(model, x), grads_of(expected, x))
    assert (plan.begun, plan.cut_short) == (5, 1)


@pytest.mark.parametrize("impl", IMPLS)
def test_R8_a_forward_let_go_ends_its_step_where_a_group_says_so(impl):
    """Groups opened by hand: a forward let go is told by its hooked groups, all let go with its
    graph; where none was hooked nothing tells, and the step goes on."""
    model = mlp_stack(3, 32, "cpu")
    for hooks, begun in (("every", 3), ("none", 1)):
        plan = _CountsSteps(hooks)
        off = ao.Offloader(impl=impl, device="cpu", plan=plan, min_offload_bytes=0)
        run_groups(model, torch.randn(8, 32, requires_grad=True), off).sum().backward()
        y = run_groups(model, torch.randn(8, 32, requires_grad=True), off)
        del y
        run_groups(model, torch.randn(8, 32, requires_grad=True), off).sum().backward()
        assert plan.begun == begun, hooks


def test_R8_prefetch_never_reaches_into_another_micro_batch():
    """Forward a, forward b, backward b: b's first group must not prefetch a's last one,
    which only a's backward needs (it would be held in device memory meanwhile)."""
    model = mlp_stack(3, 32, "cpu")
    off = ao.Offloader(impl="fast", device="cpu", min_offload_bytes=0, keep_last=0, prefetch=2)
    xa, xb = torch.randn(8, 32, requires_grad=True), torch.randn(8, 32, requires_grad=True)
    a = run_groups(model, xa, off).sum()
    b = run_groups(model, xb, off).sum()
    b.backward()
    c = off.stats()["copies"]
    assert c["prefetched_groups"] == 2  # b's 1 and 0, from b's 2; not a's
    assert c["h2d_bytes"] == c["d2h_bytes"] // 2  # only b's groups came back
    a.backward()
    assert off.stats()["copies"]["h2d_bytes"] == c["d2h_bytes"]


def test_R8_prefetch_follows_a_module_called_twice():
    block = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU())
    off = ao.Offloader(impl="fast", device="cpu", min_offload_bytes=0, keep_last=0, prefetch=1)
    with ao.wrap([block], off):  # one group (a Sequential itself would give one per layer)
        y = block(block(block(torch.randn(8, 32, requires_grad=True) * 1)))
    y.sum().backward()
    assert off.stats()["copies"]["prefetched_groups"] == 2  # same module, three groups, one graph


@pytest.mark.parametrize("impl", IMPLS)
def test_R6_allow_mutation_on_saved_tensors_works_around_a_group(impl):
    x = torch.randn(8, 64, requires_grad=True)

    def run(off):
        x.grad = None
        with torch.autograd.graph.allow_mutation_on_saved_tensors():
            if off is None:
                h = x * 2
                y = h.sin()
            else:
                with off.group("g"):
                    h = x * 2
                    y = h.sin()
            h.add_(1)  # PyTorch cloned h before this write; backward uses the saved values
            y.sum().backward()
        return x.grad.clone()

    off = off_for(impl, "cpu", keep_last=0)
    assert torch.equal(run(off), run(None))
    g = off.stats()["groups"]["g"]
    assert g["offloaded"] == 0 and g["kept"] == {"inert": g["saved"]} and g["saved"] >= 1


@pytest.mark.parametrize("impl", IMPLS)
def test_R8_checkpoint_around_a_wrapped_module_recomputes_without_opening_a_group(impl):
    model = mlp_stack(3, 32, "cpu")
    x = torch.randn(8, 32, requires_grad=True)
    expected = reference_grads(model, x)
    off = off_for(impl, "cpu", keep_last=0)
    with ao.wrap(model, off):
        h = model[0](x)
        h = torch.utils.checkpoint.checkpoint(model[1], h, use_reentrant=False)
        y = model[2](h)
        y.sum().backward()
    assert_bitwise(grads_of(model, x), expected)


@pytest.mark.parametrize("impl", IMPLS)
def test_R8_one_offloader_used_from_a_second_thread_raises_at_once(impl):
    off = off_for(impl, "cpu", keep_last=0)
    model = mlp_stack(2, 32, "cpu")
    run_groups(model, torch.randn(8, 32, requires_grad=True), off).sum().backward()
    errors = []

    def other():
        try:
            with off.group("elsewhere"):
                pass
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 1 and "forwards of one thread" in errors[0] and "torch.no_grad()" in errors[0]
    run_groups(model, torch.randn(8, 32, requires_grad=True), off).sum().backward()  # still fine here


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("saves_nothing", [torch.no_grad, torch.inference_mode])
def test_R8_a_forward_that_saves_nothing_runs_on_another_thread(impl, saves_nothing):
    """An evaluation on a thread of its own, under no_grad or inference_mode (R2: nothing is
    saved), opens no group and gives what the model gives without an offloader; training on
    the offloader's thread goes on bitwise."""
    model = mlp_stack(2, 32, "cpu")
    x = torch.randn(8, 32, requires_grad=True)
    expected = reference_grads(model, x)
    with saves_nothing():
        plain = model(x)
    with ao.wrap(model, off_for(impl, "cpu", keep_last=0)):
        model(x).sum().backward()
        assert_bitwise(grads_of(model, x), expected)
        zero_grads(model, x)
        out = {}

        def evaluate():
            with saves_nothing():
                out["y"] = model(x)

        t = threading.Thread(target=evaluate)
        t.start()
        t.join()
        assert torch.equal(out["y"], plain)
        model(x).sum().backward()  # training goes on, on the offloader's thread
        assert_bitwise(grads_of(model, x), expected)


@pytest.mark.parametrize("impl", IMPLS)
def test_R8_an_evaluation_on_a_thread_of_its_own_before_training_leaves_training_its_thread(impl):
    """The first forward, under no_grad on a thread that then ends, does not keep training on
    the main thread from opening groups: a forward with gradients on takes the offloader over, and
    from then on it is the training thread's (a second evaluation there runs plain)."""
    model = mlp_stack(3, 32, "cpu")
    x = torch.randn(8, 32, requires_grad=True)
    expected = reference_grads(model, x)
    off = off_for(impl, "cpu", keep_last=0)
    out = {}

    def evaluate(key):
        with torch.no_grad():
            out[key] = run_groups(model, x, off)

    for key in ("before", "after"):
        t = threading.Thread(target=evaluate, args=(key,))
        t.start()
        t.join()
        run_groups(model, x, off).sum().backward()
        assert_bitwise(grads_of(model, x), expected)
        assert off.stats()["offloaded_bytes"] > 0
        zero_grads(model, x)
    assert torch.equal(out["before"], out["after"])


@pytest.mark.parametrize("impl", IMPLS)
def test_R8_two_offloaders_in_two_threads_train_correctly(impl):
    results = {}

    def train(i):
        model = mlp_stack(3, 32, "cpu", seed=i)
        x = torch.randn(16, 32, requires_grad=True, generator=torch.Generator().manual_seed(i))
        expected = reference_grads(model, x)
        off = off_for(impl, "cpu", keep_last=1)
        for _ in range(5):
            run_groups(model, x, off).sum().backward()
            got = grads_of(model, x)
            for t in list(model.parameters()) + [x]:
                t.grad = None
        results[i] = all(torch.equal(a, b) for a, b in zip(got, expected))
        gc.collect()
        results[i] = results[i] and off.stats()["host_bytes_in_use"] == 0

    threads = [threading.Thread(target=train, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {0: True, 1: True}


def test_R8_an_evaluation_on_another_thread_leaves_a_memory_budgets_steps_alone(monkeypatch):
    """Under a memory budget, an evaluation of another batch size on a thread of its own (no_grad)
    neither opens a group nor hands the budget its inputs (a step's signature: from another
    thread, it could land between the training thread's and its step's first group): the plan
    settled on the training thread stays, and training goes on bitwise."""
    model = mlp_stack(3, 32, "cpu")
    x = torch.randn(8, 32, requires_grad=True)
    expected = reference_grads(model, x)
    off = ao.Offloader(impl="fast", device="cpu", min_offload_bytes=0, memory_budget="1GB")
    with ao.wrap(model, off):
        for _ in range(8):
            model(x).sum().backward()
            zero_grads(model, x)
        plan = off.stats()["plan"]
        assert plan["settled"]
        handed = []
        step_inputs = off.plan.step_inputs
        monkeypatch.setattr(off.plan, "step_inputs",
                            lambda *a: handed.append(threading.get_ident()) or step_inputs(*a))
        evaluated = {}

        def evaluate():
            with torch.no_grad():
                evaluated["y"] = model(torch.randn(64, 32))

        t = threading.Thread(target=evaluate)
        t.start()
        t.join()
        assert evaluated["y"].shape == (64, 32) and handed == []
        model(x).sum().backward()
        assert handed and set(handed) == {threading.get_ident()}
        assert_bitwise(grads_of(model, x), expected)
        after = off.stats()["plan"]
        assert after["settled"] and after["workload"] == plan["workload"] and after["plans_tried"] == plan["plans_tried"]
