"""Data-parallel Muon (OPTIMIZER.md T14): 2 and 4 gloo ranks against one process, checkpoints
across world sizes, the ownership rule, NorMuon's second moments (on their owners, gathered into a
complete state dict; one matrix split by heads), and MuonClip's S_max all-reduce under it.

Two spawned groups (4 ranks, then 2) run every multi-rank check; each rank saves what it saw and
the tests compare that with a single-process run here. The gradients stand in for DDP's averaged
ones: seeded per step and parameter, the same on every rank.
"""

from __future__ import annotations

import copy
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import optim
from tests.optim.tiny_models import CausalSelfAttention
from tests.support.net import free_port

pytestmark = pytest.mark.system  # its tests start processes: the service's, torchrun's or a command's

# Muon matrices of several shapes (two alike, so a rank batches them; a conv kernel), an experts
# group [E, out, in] and an AdamW group: the split over 2 and 4 ranks is uneven in count and shape.
MUON_SHAPES = [(48, 16), (16, 48), (32, 32), (32, 32), (24, 40), (8, 2, 3, 3)]
EXPERT_SHAPES = [(4, 24, 16)]
ADAMW_SHAPES = [(16,), (50, 16)]
SHAPES = MUON_SHAPES + EXPERT_SHAPES + ADAMW_SHAPES
N_MUON = len(MUON_SHAPES) + len(EXPERT_SHAPES)
STEPS, RESUME_AT = 20, 10
NO_GRAD_PARAM, NAN_PARAM, NAN_STEP = 1, 2, 5  # one parameter skips some steps, one has a NaN gradient once
KWARGS = dict(lr=0.02, weight_decay=0.01, ns_dtype=torch.float32, adamw_lr=1e-3, adamw_weight_decay=0.1)
TOL = 1e-6  # max abs difference / max abs value, per parameter
JOIN_TIMEOUT_S = 150.0  # for a whole group; a rank stuck in a collective gives up after 60 s


def make_params() -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(shape, generator=gen) * 0.1) for shape in SHAPES]


def param_groups(ps: list[nn.Parameter], per_head: bool = False) -> list[dict]:
    """The groups; ``per_head``: the first matrix (48 rows) orthogonalized as four heads of 8 rows
    and a block of 16, as a fused QKV weight is (``row_blocks``)."""
    n = len(MUON_SHAPES)
    first = [{"params": ps[:1], "row_blocks": (8, 8, 8, 8, 16)}] if per_head else []
    return [
        *first,
        {"params": ps[len(first) : n]},
        {"params": ps[n:N_MUON], "experts": True},
        {"params": ps[N_MUON:], "use_muon": False},
    ]


def set_grads(ps: list[nn.Parameter], step: int) -> None:
    for i, p in enumerate(ps):
        if i == NO_GRAD_PARAM and step % 4 == 3:
            p.grad = None  # absent on every rank alike (DDP's find_unused_parameters)
            continue
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 * step + i))
        if i == NAN_PARAM and step == NAN_STEP:
            p.grad[0, 0] = float("nan")


def train(opt: optim.Muon, ps: list[nn.Parameter], steps: range) -> list[dict[str, float]]:
    """Step over the given steps; each step's statistics (but its wall time)."""
    stats = []
    for step in steps:
        set_grads(ps, step)
        opt.step()
        stats.append({k: v for k, v in opt.last_step_stats().items() if k != "ns_time_ms"})
    return stats


def snapshot(ps: list[nn.Parameter]) -> list[torch.Tensor]:
    return [p.detach().clone() for p in ps]


def load_params(ps: list[nn.Parameter], values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, v in zip(ps, values):
            p.copy_(v)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def assert_close(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    worst = max(rel_diff(a, b) for a, b in zip(got, want))
    assert worst <= TOL, f"{what}: max relative difference {worst:.2e} > {TOL:.0e}"


def assert_stats_close(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want)):
        assert a["nonfinite_skipped"] == b["nonfinite_skipped"], step
        assert a["update_rms"] == pytest.approx(b["update_rms"], rel=1e-5), step


# ---- the single-process reference ----


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """A plain Muon over STEPS steps: final parameters, per-step stats, and the parameters and
    state dict at RESUME_AT (also saved, for the 2-rank group to resume from)."""
    ps = make_params()
    opt = optim.Muon(param_groups(ps), **KWARGS)
    stats = train(opt, ps, range(RESUME_AT))
    at_resume = {"params": snapshot(ps), "state": copy.deepcopy(opt.state_dict())}
    stats += train(opt, ps, range(RESUME_AT, STEPS))
    path = tmp_path_factory.mktemp("reference") / "resume.pt"
    torch.save(at_resume, path)
    return {"final": snapshot(ps), "stats": stats, "resume": at_resume, "resume_path": str(path)}


@pytest.fixture(scope="module")
def normuon_reference() -> dict:
    """NorMuon in one process over STEPS steps (one matrix split by heads): final parameters and
    the state dict at RESUME_AT."""
    ps = make_params()
    opt = optim.Muon(param_groups(ps, per_head=True), **KWARGS, normuon=True)
    stats = train(opt, ps, range(RESUME_AT))
    state = copy.deepcopy(opt.state_dict())
    stats += train(opt, ps, range(RESUME_AT, STEPS))
    return {"final": snapshot(ps), "state": state, "stats": stats}


# ---- what the ranks run ----


def run_modes(out: dict) -> None:
    """STEPS steps with and without momentum sharding; sharded, also the state dict at RESUME_AT."""
    for shard in (False, True):
        ps = make_params()
        opt = optim.Muon(param_groups(ps), **KWARGS, distributed=True, shard_momentum=shard)
        if shard:  # before any step no owner holds a buffer: the gathered state is empty
            out["state_before_step"] = opt.state_dict()["state"]
        stats = train(opt, ps, range(RESUME_AT))
        if shard:
            out["resume"] = {"params": snapshot(ps), "state": copy.deepcopy(opt.state_dict())}
        stats += train(opt, ps, range(RESUME_AT, STEPS))
        out[f"shard={shard}"] = {
            "final": snapshot(ps),
            "stats": stats,
            "has_state": [p in opt.state for p in ps],
        }


def normuon_runs(out: dict) -> None:
    """NorMuon over STEPS steps (one matrix split by heads), with and without momentum sharding;
    the state dict at RESUME_AT."""
    for shard in (False, True):
        ps = make_params()
        opt = optim.Muon(
            param_groups(ps, per_head=True), **KWARGS, normuon=True, distributed=True, shard_momentum=shard
        )
        stats = train(opt, ps, range(RESUME_AT))
        state = copy.deepcopy(opt.state_dict())
        stats += train(opt, ps, range(RESUME_AT, STEPS))
        out[f"normuon shard={shard}"] = {"final": snapshot(ps), "state": state, "stats": stats}


def resume(path: str, shard: bool) -> dict:
    """Load a checkpoint (parameters and optimizer state at RESUME_AT) and train to STEPS."""
    saved = torch.load(path)
    ps = make_params()
    load_params(ps, saved["params"])
    opt = optim.Muon(param_groups(ps), lr=0.5, distributed=True, shard_momentum=shard)  # lr: from the checkpoint
    opt.load_state_dict(saved["state"])
    loaded = [p in opt.state for p in ps]
    train(opt, ps, range(RESUME_AT, STEPS))
    return {"final": snapshot(ps), "has_state_after_load": loaded}


def solo_group(rank: int, world: int, out: dict) -> None:
    """distributed=True over a one-rank process group is the plain optimizer, bit for bit."""
    groups = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    a, b = make_params(), make_params()
    opt_a = optim.Muon(param_groups(a), **KWARGS)
    opt_b = optim.Muon(param_groups(b), **KWARGS, distributed=True, process_group=groups[rank], shard_momentum=True)
    train(opt_a, a, range(5))
    train(opt_b, b, range(5))
    out["solo_equal"] = all(torch.equal(x, y) for x, y in zip(a, b))


def one_sided_grads(rank: int, out: dict) -> None:
    """A gradient present on one rank only breaks the assumption, yet must not hang the step:
    the owner's parameter wins on every rank."""
    ps = make_params()
    opt = optim.Muon(param_groups(ps), **KWARGS, distributed=True)
    for step in range(3):
        set_grads(ps, step)
        if rank == 1 and step == 1:
            for p in ps[:N_MUON]:
                p.grad = None
        opt.step()
    out["one_sided"] = snapshot(ps[:N_MUON])


def late_group(out: dict) -> None:
    """With sharded momentum a group added after a step would re-deal owners under held buffers."""
    ps = make_params()
    opt = optim.Muon(param_groups(ps[:-1]), **KWARGS, distributed=True, shard_momentum=True)
    train(opt, ps[:-1], range(1))
    try:
        opt.add_param_group({"params": [ps[-1]]})
    except RuntimeError as exc:
        out["late_group"] = str(exc)


CLIP_MAXIMA = {0: [300.0, 10.0, 20.0, 5.0], 1: [20.0, 500.0, 30.0, 5.0]}  # per rank, per head
CLIP_STEPS = 3


def clip_run(maxima: list[list[float]], **kwargs) -> tuple[list[torch.Tensor], list[float]]:
    """MuonClip on an MLA attention layer: each step records the given per-head maxima."""
    torch.manual_seed(3)
    attn = CausalSelfAttention(32, 4, "mla")
    ps = list(attn.parameters())
    opt = optim.MuonClip(ps, attn, qk_clip_tau=100.0, lr=0.02, ns_dtype=torch.float32, **kwargs)
    clipped = []
    for step in range(CLIP_STEPS):
        for i, p in enumerate(ps):
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i))
        for s in maxima:
            attn.record(torch.tensor(s))
        opt.step()
        clipped.append(opt.last_step_stats()["qk_clip/heads_clipped"])
    return snapshot(ps), clipped


def _worker(rank: int, world: int, port: int, out_dir: str, jobs: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    out: dict = {}
    try:
        run_modes(out)
        normuon_runs(out)
        if "resume" in jobs:
            out["resumed"] = {name: resume(path, shard) for name, (path, shard) in jobs["resume"].items()}
        if jobs.get("extras"):
            solo_group(rank, world, out)
            one_sided_grads(rank, out)
            late_group(out)
            out["clip"] = clip_run([CLIP_MAXIMA[rank]], distributed=True, shard_momentum=True)
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    except BaseException:
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def spawn(world: int, out_dir: Path, jobs: dict) -> list[dict]:
    """Run _worker on `world` gloo ranks; every rank's results, or a failure naming what went wrong.

    The ranks are forked from a fork server that has imported torch once (a fresh process, so no
    thread pools are forked): six ranks importing torch each (and torch._dynamo, which the first
    optimizer a process builds pulls in) would cost about 30 s of CPU.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch._dynamo", __name__])
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, str(out_dir), jobs)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for p in procs:
        p.join(timeout=max(1.0, deadline - time.monotonic()))
    hung = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    errors = "\n".join(f.read_text() for f in sorted(out_dir.glob("*.err")))
    assert not hung, f"ranks did not finish (pids {hung})\n{errors}"
    assert [p.exitcode for p in procs] == [0] * world, errors
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> tuple[list[dict], str]:
    out_dir = tmp_path_factory.mktemp("four")
    ranks = spawn(4, out_dir, {})
    path = out_dir / "resume.pt"
    torch.save(ranks[0]["resume"], path)
    return ranks, str(path)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, reference, four_ranks) -> list[dict]:
    jobs = {
        "resume": {"from 4 ranks, sharded": (four_ranks[1], False), "from 1 process": (reference["resume_path"], True)},
        "extras": True,
    }
    return spawn(2, tmp_path_factory.mktemp("two"), jobs)


def world_results(request, world: int) -> list[dict]:
    if world == 2:
        return request.getfixturevalue("two_ranks")
    return request.getfixturevalue("four_ranks")[0]


def expected_owners(world: int) -> list[int]:
    """What every rank must deal: the pure rule on the Muon shapes, in param-group order."""
    views = [optim.matrix_shape(s, False) for s in MUON_SHAPES] + [optim.matrix_shape(s, True) for s in EXPERT_SHAPES]
    return optim.assign_owners([optim.ns_flops(v) for v in views], world)


# ---- 1. the same parameters as one process ----


@pytest.mark.parametrize("shard", [False, True])
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_match_one_process_after_20_steps(request, reference, world, shard):
    ranks = world_results(request, world)
    runs = [r[f"shard={shard}"] for r in ranks]
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run["final"], runs[0]["final"])), "ranks differ"
    assert_close(runs[0]["final"], reference["final"], f"{world} ranks, shard_momentum={shard}")
    for run in runs:  # update_rms and nonfinite_skipped are global, on every rank
        assert_stats_close(run["stats"], reference["stats"])
    assert reference["stats"][NAN_STEP]["nonfinite_skipped"] == 1
    assert set(expected_owners(world)) == set(range(world))  # every rank has work


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_momentum_lives_on_its_owner_only(request, world):
    owners = expected_owners(world)
    for rank, result in enumerate(world_results(request, world)):
        held = result["shard=True"]["has_state"]
        assert held[:N_MUON] == [owner == rank for owner in owners]
        assert all(held[N_MUON:])  # AdamW state: every rank
        assert all(result["shard=False"]["has_state"])  # unsharded: everything, everywhere


# ---- 2. checkpoints across world sizes ----


def test_sharded_state_dict_is_complete_and_alike_on_every_rank(four_ranks, reference):
    ranks, _ = four_ranks
    want = reference["resume"]["state"]
    for result in ranks:
        assert result["state_before_step"] == {}
        got = result["resume"]["state"]
        assert got["param_groups"] == want["param_groups"]
        assert got["state"].keys() == want["state"].keys()
        for i, state in want["state"].items():
            assert got["state"][i].keys() == state.keys()
            for key, value in state.items():
                assert torch.equal(got["state"][i][key], ranks[0]["resume"]["state"]["state"][i][key])
                if key != "step":
                    assert rel_diff(got["state"][i][key], value) <= TOL, (i, key)


def test_four_rank_checkpoint_resumes_in_one_process(four_ranks, reference):
    _, path = four_ranks
    saved = torch.load(path)
    ps = make_params()
    load_params(ps, saved["params"])
    opt = optim.Muon(param_groups(ps), lr=0.5)
    opt.load_state_dict(saved["state"])
    train(opt, ps, range(RESUME_AT, STEPS))
    assert_close(snapshot(ps), reference["final"], "4 ranks (sharded) -> 1 process")


@pytest.mark.parametrize("source", ["from 4 ranks, sharded", "from 1 process"])
def test_checkpoint_resumes_on_two_ranks(two_ranks, reference, source):
    for result in two_ranks:
        assert_close(result["resumed"][source]["final"], reference["final"], f"{source} -> 2 ranks")
    if source == "from 1 process":  # loaded into a sharded optimizer: each rank keeps its own buffers
        owners = expected_owners(2)
        for rank, result in enumerate(two_ranks):
            assert result["resumed"][source]["has_state_after_load"][:N_MUON] == [o == rank for o in owners]


@pytest.mark.parametrize("shard", [False, True])
@pytest.mark.parametrize("world", [2, 4])
def test_normuon_on_ranks_matches_one_process_and_its_state_dict_is_complete(request, normuon_reference, world, shard):
    want = normuon_reference["state"]["state"]
    for result in world_results(request, world):
        run = result[f"normuon shard={shard}"]
        assert_close(run["final"], normuon_reference["final"], f"NorMuon on {world} ranks, shard_momentum={shard}")
        got = run["state"]["state"]
        assert got.keys() == want.keys()
        for i in range(N_MUON):  # every second moment, whichever rank owns it
            assert rel_diff(got[i]["second_moment"], want[i]["second_moment"]) <= TOL, i
        assert_stats_close(run["stats"], normuon_reference["stats"])
        for a, b in zip(run["stats"], normuon_reference["stats"]):  # the spread: a mean over every rank's matrices
            assert a["normuon/scale_spread"] == pytest.approx(b["normuon/scale_spread"], rel=1e-5)


# ---- 3. the ownership rule ----


def gpt_like_costs(d_model: int = 768, n_layers: int = 12) -> list[int]:
    shapes = [(3 * d_model, d_model), (d_model, d_model), (4 * d_model, d_model), (d_model, 4 * d_model)]
    return [optim.ns_flops(optim.matrix_shape(s, False)) for _ in range(n_layers) for s in shapes]


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_owners_are_balanced_on_a_gpt_like_set(world):
    costs = gpt_like_costs()
    owners = optim.assign_owners(costs, world)
    assert len(owners) == len(costs) and set(owners) == set(range(world))  # each owned once, every rank used
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(world)]
    assert max(loads) / (sum(loads) / world) <= 1.05


def test_owners_largest_first_ties_in_order_and_deterministic():
    costs = [1, 5, 5, 2]
    # 5 (item 1) -> rank 0; 5 (item 2) -> rank 1; 2 -> rank 0 (loads tie: the lowest rank); 1 -> rank 1
    assert optim.assign_owners(costs, 2) == [1, 0, 1, 0]
    assert optim.assign_owners(costs, 1) == [0, 0, 0, 0]
    assert optim.assign_owners([], 4) == []
    costs = gpt_like_costs(256, 4)
    assert optim.assign_owners(costs, 4) == optim.assign_owners(list(costs), 4)
    with pytest.raises(ValueError):
        optim.assign_owners(costs, 0)


def test_ns_flops_follow_the_matrix_view():
    assert optim.ns_flops(optim.matrix_shape((64, 256), False)) == 4 * 64 * 64 * 256 + 2 * 64**3
    assert optim.ns_flops(optim.matrix_shape((256, 64), False)) == optim.ns_flops((1, 64, 256))  # oriented wide
    assert optim.ns_flops(optim.matrix_shape((8, 64, 32), True)) == 8 * optim.ns_flops((1, 32, 64))  # per expert
    assert optim.matrix_shape((256, 1, 3, 3), False) == (1, 256, 9)  # a conv kernel, flattened


def test_distributed_needs_an_initialised_process_group():
    ps = make_params()
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        optim.Muon(param_groups(ps), distributed=True)
    with pytest.raises(ValueError, match="distributed=True"):
        optim.Muon(param_groups(ps), shard_momentum=True)
    with pytest.raises(ValueError, match="distributed"):
        optim.Muon(param_groups(ps), distributed="yes")


# ---- the rest: world size 1, a one-sided gradient, MuonClip ----


def test_a_one_rank_group_is_the_plain_optimizer(two_ranks):
    assert all(result["solo_equal"] for result in two_ranks)


def test_a_gradient_on_one_rank_only_does_not_hang(two_ranks):
    first, second = (result["one_sided"] for result in two_ranks)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_a_late_param_group_is_refused_with_sharded_momentum(two_ranks):
    assert all("before the first step" in result.get("late_group", "") for result in two_ranks)


def test_muonclip_on_two_ranks_matches_one_process(two_ranks):
    want, want_clipped = clip_run(list(CLIP_MAXIMA.values()))  # one process sees both ranks' maxima
    assert want_clipped[0] == 2  # heads 0 and 1, each over tau on one rank only
    for result in two_ranks:
        got, clipped = result["clip"]
        assert clipped == want_clipped
        assert_close(got, want, "MuonClip, 2 ranks")
