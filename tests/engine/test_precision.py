"""Float32 master weights for bfloat16 training (`engine.precision`, ``trainer.master_weights``)."""

import copy
from dataclasses import replace
from typing import Any

import pytest
import torch

from searchrl.core.config import TrainerConfig
from searchrl.engine.precision import Float32Gradients, MasterWeights, with_master_weights

from .test_trainer import trainer_for

# compares two computation paths of the same numbers: .ci/run runs these again under a second floating-point
# path (other kernels, one thread), so a tolerance that holds on one CPU's kernels only fails in CI
pytestmark = pytest.mark.numerics

OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-6, "weight_decay": 0.01}),
    "sgd-momentum": (torch.optim.SGD, {"lr": 1e-6, "momentum": 0.9}),
}


def _runs(cls, kw, steps, seed=0):
    """The same gradients through (a) the master-weight optimizer on bfloat16 parameters, (b) the plain one
    on float32 copies of the same starting values, (c) the plain one on the bfloat16 parameters."""
    gen = torch.Generator().manual_seed(seed)
    w0 = (torch.randn(64, 96, generator=gen) * 0.02).bfloat16()
    mixed, ref, plain = (torch.nn.Parameter(w0.clone()) for _ in range(3))
    ref.data = ref.data.float()
    opts = [with_master_weights(cls)([mixed], **kw), cls([ref], **kw), cls([plain], **kw)]
    for _ in range(steps):
        g = torch.randn(w0.shape, generator=gen)
        mixed.grad, ref.grad, plain.grad = g.bfloat16(), g.bfloat16().float(), g.bfloat16()
        for o in opts:
            o.step()
    return w0, (mixed, ref, plain), opts


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_master_weights_step_as_float32_and_round_once(name):
    cls, kw = OPTIMIZERS[name]
    w0, (mixed, ref, plain), (opt, _, _) = _runs(cls, kw, steps=20)
    assert mixed.dtype == torch.bfloat16 and mixed.grad.dtype == torch.bfloat16  # the model is untouched
    master = opt.state[mixed]["master"]
    assert master.dtype == torch.float32 and torch.equal(master, ref.detach())  # exactly the float32 run
    assert torch.equal(mixed.detach(), ref.detach().bfloat16())  # the parameter: that run, rounded
    assert all(v.dtype == torch.float32 for k, v in opt.state[mixed].items() if k != "step")
    # what it prevents: stepped in place, the bfloat16 parameter drifts away from the float32 run, because
    # updates below half a rounding step are dropped (most of them at these learning rates)
    true_move = (ref.detach() - w0.float()).abs().mean()
    plain_err = (plain.detach().float() - ref.detach()).abs().mean()
    assert plain_err > 0.5 * true_move


def test_updates_too_small_to_round_accumulate_until_they_show():
    start = torch.full((8,), 0.02).bfloat16()
    w, plain = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    opts = with_master_weights(torch.optim.SGD)([w], lr=1.0), torch.optim.SGD([plain], lr=1.0)
    spacing = 2.0**-13  # between bfloat16 values in [2^-6, 2^-5)
    moves = []
    for _ in range(6):
        w.grad = torch.full_like(w, -0.4 * spacing)  # 0.4 of a rounding step up each time
        plain.grad = w.grad.clone()
        for o in opts:
            o.step()
        moves.append(round((float(w.detach()[0]) - float(start[0])) / spacing))
    assert moves == [0, 1, 1, 2, 2, 2]  # round(0.4 k): the sum of the updates, rounded once
    assert torch.equal(plain.detach(), start)  # stepped in bfloat16, each update is rounded away


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_loaded_state_keeps_its_float32_copies(name):
    cls, kw = OPTIMIZERS[name]
    _, (mixed, _, _), (opt, _, _) = _runs(cls, kw, steps=6)
    saved = copy.deepcopy(opt.state_dict())
    again = torch.nn.Parameter(mixed.detach().clone())
    opt2 = with_master_weights(cls)([again], **kw)
    opt2.load_state_dict(saved)  # torch would cast every state tensor to bfloat16
    assert all(v.dtype == torch.float32 for k, v in opt2.state[again].items() if k != "step")
    gen = torch.Generator().manual_seed(7)
    for _ in range(4):  # the resumed optimizer continues exactly as the original does
        g = torch.randn(mixed.shape, generator=gen).bfloat16()
        mixed.grad, again.grad = g, g.clone()
        opt.step()
        opt2.step()
    assert torch.equal(opt.state[mixed]["master"], opt2.state[again]["master"])
    assert torch.equal(mixed.detach(), again.detach())


def test_float32_parameters_are_stepped_as_they_are():
    p = torch.nn.Parameter(torch.ones(4))
    q = torch.nn.Parameter(torch.ones(4))
    a, b = with_master_weights(torch.optim.AdamW)([p], lr=0.1), torch.optim.AdamW([q], lr=0.1)
    for _ in range(3):
        p.grad, q.grad = torch.arange(4.0), torch.arange(4.0)
        a.step()
        b.step()
    assert torch.equal(p, q) and "master" not in a.state[p]


@pytest.mark.parametrize("master", [True, False])
def test_the_trainer_keeps_master_weights_for_a_bfloat16_policy(make_exp, master):
    exp = make_exp("model.dtype=bfloat16", "rewards=[{name: test_trainer_length}]", "rollout.temperature=1.0")
    cfg = TrainerConfig(steps=1, batch_size=2, micro_batch_size=4, lr=1e-3, master_weights=master)
    tr = trainer_for(exp, "grpo", cfg)
    tr.step(0)
    inner = getattr(tr.optimizer, "optimizer", tr.optimizer)  # accelerate's wrapper
    assert isinstance(inner, MasterWeights) is master
    params = [p for p in tr.policy.parameters() if p.requires_grad]
    assert params and all(p.dtype == torch.bfloat16 for p in params)
    states = [inner.state[p] for p in params]
    if master:
        assert all(s["master"].dtype == torch.float32 for s in states)
        assert all(s["exp_avg"].dtype == torch.float32 for s in states)
        assert all(torch.equal(p.detach(), s["master"].bfloat16()) for p, s in zip(params, states))
    else:
        assert all("master" not in s and s["exp_avg"].dtype == torch.bfloat16 for s in states)


def test_a_bfloat16_run_resumed_from_its_checkpoint_ends_where_an_uninterrupted_one_does(make_exp, tmp_path):
    """The checkpoint holds the float32 copies: a resumed run continues from them, not from the rounded
    weights (which would lose the progress below a rounding step that the copies carry)."""
    exp = make_exp("model.dtype=bfloat16", "rewards=[{name: test_trainer_length}]", "rollout.temperature=1.0")
    cfg = TrainerConfig(steps=4, batch_size=2, micro_batch_size=4, lr=1e-5, save_every=2)
    whole = trainer_for(exp, "grpo", cfg, out=tmp_path / "a")
    whole.run()
    first = trainer_for(exp, "grpo", replace(cfg, steps=2), out=tmp_path / "b")
    first.run()
    resumed = trainer_for(exp, "grpo", cfg, out=tmp_path / "b", resume=True)
    assert resumed.start_step == 2
    inner = resumed.optimizer.optimizer
    assert all(inner.state[p]["master"].dtype == torch.float32 for p in resumed.policy.parameters())
    resumed.run()
    for (name, a), b in zip(whole.policy.named_parameters(), resumed.policy.parameters()):
        assert torch.equal(a, b), name


def test_master_weights_are_chosen_for_low_precision_parameters_outside_deepspeed():
    from searchrl.engine.precision import use_master_weights

    bf16 = [{"params": [torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]}]
    fp32 = [{"params": [torch.nn.Parameter(torch.zeros(3))]}]
    said: list[str] = []
    assert use_master_weights(True, bf16, deepspeed=False, say=said.append)
    assert "master weights" in said[-1]
    assert not use_master_weights(True, bf16, deepspeed=True, say=said.append)  # DeepSpeed keeps its own
    assert not use_master_weights(True, fp32, deepspeed=False, say=said.append)  # nothing to copy
    assert len(said) == 1
    assert not use_master_weights(False, bf16, deepspeed=False, say=said.append)
    assert said[-1].startswith("warning:") and "trainer.master_weights: false" in said[-1]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_step_in_chunks_equals_one_float32_step(name, monkeypatch):
    """The float32 gradient copies are made a chunk at a time (``chunk_numel``): split over several
    parameters, groups and chunks, the result is still exactly the float32 run's, rounded once."""
    cls, kw = OPTIMIZERS[name]
    gen = torch.Generator().manual_seed(3)
    shapes = [(5, 7), (3,), (11, 2), (4, 4), (6,)]
    w0 = [(torch.randn(s, generator=gen) * 0.02).bfloat16() for s in shapes]
    mixed = [torch.nn.Parameter(w.clone()) for w in w0]
    ref = [torch.nn.Parameter(w.float()) for w in w0]
    head = torch.nn.Parameter(torch.randn(3, generator=gen))  # a float32 parameter beside them
    head_ref = torch.nn.Parameter(head.detach().clone())
    opt = with_master_weights(cls)([{"params": mixed[:2]}, {"params": [*mixed[2:], head], "lr": 3e-6}], **kw)
    ref_opt = cls([{"params": ref[:2]}, {"params": [*ref[2:], head_ref], "lr": 3e-6}], **kw)
    monkeypatch.setattr(opt, "chunk_numel", 40)
    for step in range(4):
        for m, r in zip([*mixed, head], [*ref, head_ref]):
            g = torch.randn(m.shape, generator=gen)
            m.grad, r.grad = g.to(m.dtype), g.to(m.dtype).float()
        if (
            step == 0
        ):  # gradients now set: the split has several chunks, none over the bound but a lone parameter
            parts = opt._parts([g["params"] for g in opt.param_groups])
            sizes = [
                sum(p.numel() for ps in part for p in ps if p.dtype == torch.bfloat16) for part in parts[1:]
            ]
            assert len(sizes) >= 3 and all(s <= 40 for s in sizes)
            assert parts[0] == [[], [head]]  # the float32 parameter, stepped as it is
        opt.step()
        ref_opt.step()
    assert [g["params"] for g in opt.param_groups] == [mixed[:2], [*mixed[2:], head]]  # restored
    for m, r in zip(mixed, ref):
        assert torch.equal(opt.state[m]["master"], r.detach()) and torch.equal(
            m.detach(), r.detach().bfloat16()
        )
    assert torch.equal(head, head_ref)


# ---------------------------------------------------------------------- float32 gradient accumulation
# below half of bfloat16's rounding step at 1.0 (2^-8): added to 1.0 in place, it is lost
SMALL = 3 * 2.0**-10


def _micro_grads(n: int) -> list[torch.Tensor]:
    """Gradients of ``n`` micro-batches for a (4,) parameter: 1.0 first, then small ones."""
    return [torch.ones(4)] + [torch.full((4,), SMALL) for _ in range(n - 1)]


def _accumulate(p: torch.nn.Parameter, grads: list[torch.Tensor]) -> None:
    """One backward pass per micro-batch into ``p`` (loss = <p, g>)."""
    for g in grads:
        (p.float() * g).sum().backward()


@pytest.mark.parametrize("distributed", [False, True])
def test_gradients_are_summed_in_float32_and_rounded_once(distributed):
    """One process: every pass folded, the float32 total rounded once. Under DDP the sums go back before the
    last pass (which reduces them): rounded, then the last gradient added in bfloat16."""
    grads = _micro_grads(16)
    plain = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    _accumulate(plain, grads)
    assert torch.equal(plain.grad, torch.ones(4, dtype=torch.bfloat16))  # in place: every small one lost

    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    g32 = Float32Gradients([p], distributed=distributed)
    for i, g in enumerate(grads):
        last = i == len(grads) - 1
        g32.before_backward(last)
        (p.float() * g).sum().backward()
        if not last:  # folded: the parameter's own gradient freed, the sum in float32
            assert p.grad is None and g32.sums[p].dtype == torch.float32
        g32.after_backward(last)
    assert not g32.sums and not g32.folding
    total32 = sum(grads, torch.zeros(4))  # float32: 1 + 15 * SMALL
    if distributed:
        expect = ((total32 - grads[-1]).bfloat16().float() + grads[-1]).bfloat16()
    else:
        expect = total32.bfloat16()
    assert torch.equal(p.grad, expect) and p.grad.dtype == torch.bfloat16
    assert (p.grad.float() - total32).abs().max() <= (2.0**-7 if distributed else 2.0**-8)
    assert p.grad[0] > 1.03  # the small gradients count


def test_float32_gradients_leave_other_parameters_and_passes_alone():
    full = torch.nn.Parameter(torch.zeros(4))  # float32 (a LoRA adapter): accumulates as it is
    frozen = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16), requires_grad=False)
    low = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    g32 = Float32Gradients([full, frozen, low])
    assert g32.params == [low]
    g32.folding = True
    ((full + low.float()) * torch.ones(4)).sum().backward()
    assert low.grad is None and torch.equal(full.grad, torch.ones(4)) and low in g32.sums
    g32.clear()  # an update that did not finish leaves nothing behind
    assert not g32.sums and not g32.folding
    ((full + low.float()) * torch.ones(4)).sum().backward()
    assert torch.equal(low.grad, torch.ones(4, dtype=torch.bfloat16))  # not folding: in place, as before
    g32.remove()
    g32.folding = True
    (low.float().sum()).backward()
    assert not g32.sums  # no hooks left


@pytest.mark.parametrize("master", [True, False])
def test_the_trainer_sums_a_bfloat16_policys_gradients_in_float32(make_exp, master, monkeypatch):
    """Several micro-batches per update: every low-precision gradient is summed in float32 over them (its own
    gradient freed meanwhile), once per update; without master weights nothing is folded."""
    seen: list[dict] = []
    unfold = Float32Gradients.unfold

    def spy(self):
        seen.append({p: (p.grad, s.dtype) for p, s in self.sums.items()})
        unfold(self)

    monkeypatch.setattr(Float32Gradients, "unfold", spy)
    exp = make_exp("model.dtype=bfloat16", "rewards=[{name: test_trainer_length}]", "rollout.temperature=1.0")
    cfg = TrainerConfig(steps=1, batch_size=2, micro_batch_size=2, lr=1e-3, master_weights=master)
    tr = trainer_for(exp, "grpo", cfg)
    assert tr.engine.grad_accum > 1
    if not master:
        assert tr.training_step.model.grads32 is None
        return
    params = [p for p in tr.policy.parameters() if p.requires_grad]
    assert tr.training_step.model.grads32.params == params
    before = [p.detach().clone() for p in params]
    tr.step(0)
    assert seen and all(set(s) == set(params) for s in seen)  # once per update, every parameter folded
    assert all(g is None and dt == torch.float32 for s in seen for g, dt in s.values())
    assert not tr.training_step.model.grads32.sums and not tr.training_step.model.grads32.folding
    assert any(not torch.equal(a, p) for a, p in zip(before, params))


class _Dot(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return (self.p.float() * g).sum()


def _ddp_accumulate(rank: int, world: int, init: str, out: str, fold: bool) -> None:
    """One process of `test_float32_sums_go_through_ddps_reduction`: 16 micro-batches under DDP, the
    first 15 without synchronising, as accelerate's accumulation runs them."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model = torch.nn.parallel.DistributedDataParallel(_Dot())
        g32 = Float32Gradients(list(model.parameters()), distributed=True) if fold else None
        grads = _micro_grads(16)
        grads[0] = grads[0] * (rank + 1)  # rank 0 starts at 1.0, rank 1 at 2.0
        for i, g in enumerate(grads):
            last = i == len(grads) - 1
            if g32 is not None:
                g32.before_backward(last)
            if last:
                model(g).backward()
            else:
                with model.no_sync():
                    model(g).backward()
            if g32 is not None:
                g32.after_backward(last)
        if rank == 0:
            torch.save(model.module.p.grad, out)
        dist.barrier()  # both done with their collectives before either tears the group down
        del model
    finally:
        dist.destroy_process_group()


def _spawn_ddp(tmp_path: Any, fold: bool) -> torch.Tensor:
    """The reduced gradient of a 2-process run of `_ddp_accumulate`. A process that aborts (SIGABRT: gloo's
    threads at exit, which test_distributed's launches also retry once) gets one retry on a fresh store."""
    import torch.multiprocessing as mp

    for attempt in range(2):
        out = tmp_path / f"grad-{fold}-{attempt}.pt"
        init = (tmp_path / f"init-{fold}-{attempt}").as_uri()
        try:
            mp.spawn(_ddp_accumulate, args=(2, init, str(out), fold), nprocs=2, join=True)
        except mp.ProcessExitedException as exc:
            if exc.signal_name != "SIGABRT" or attempt:
                raise
            continue
        return torch.load(out).float()
    raise AssertionError("unreachable")


@pytest.mark.distributed
def test_float32_sums_go_through_ddps_reduction(tmp_path):
    """Under DDP the last micro-batch's pass reduces the whole sum over the processes: the gradient is the
    float32 average within a rounding step, where accumulation in place loses every small micro-batch."""
    got = {fold: _spawn_ddp(tmp_path, fold) for fold in (True, False)}
    exact = 1.5 + 15 * SMALL  # ((1 + 15 SMALL) + (2 + 15 SMALL)) / 2
    assert (got[True] - exact).abs().max() <= 2.0**-6  # within a rounding step at 2.0
    assert torch.equal(got[False], torch.full((4,), 1.5))  # in place: all 15 small ones lost on both
