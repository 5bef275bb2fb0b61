"""An actor generating in place on its ZeRO-3 training layout cannot hang (issue 28, item 1).

dp replicas of a real DeepSpeed ZeRO-3 engine (CPU, gloo, under NCCL's rules) generate their own prompts: the
first replica's answers all end at EOS on their first token, the others' all run to the cap. DeepSpeed gathers
the partitioned parameters over the dp group in every forward, so replicas that run different numbers of
forwards would wait on each other for ever. Both modes of ``runtime/store/zero3_generation.py`` must finish, and
give the tokens and log-probs of a one-rank generation of the same prompts:

* ``lockstep``: the rollout runs on the partitioned module; a replica with nothing left joins the others'
  forwards with an empty one (``rollout.py``), so every forward's gathers have all their ranks.
* ``gather_once``: the stage's parameters are gathered once, into a plain copy the rollout runs on, and dropped.

The prompts are chosen, not hard-coded: a seeded random model's greedy answers (without EOS) are computed on one
rank, EOS is the first answer token of one prompt, the stopping prompts are those whose first token it is and the
running ones those whose whole answer avoids it. ``scale`` cases (dp4, dp8, dp4 x tp2) run with ``--scale``.
"""

from __future__ import annotations

import pytest
import torch

from restage.layout import Layout, ProcessGroups, Strategy
from restage.models.arch import ModelConfig
from restage.rollout.sampling import SamplingParams
from restage.runtime.control.spawn import spawn

pytestmark = pytest.mark.multirank

CAP = 10  # max_new_tokens: the running replicas' answers are this long, the stopping replica's are 1 token
PER_REPLICA = 2  # prompts per replica
# The MLP's matrices (128 x 1024) are over DeepSpeed's default persistence threshold (1e5 elements), so ZeRO-3
# partitions them and gathers them in every forward; the smaller parameters stay gathered (``ds_persist``).
CFG = ModelConfig(family="llama", model_type="llama", vocab_size=61, hidden_size=128, intermediate_size=1024,
                  num_layers=2, num_heads=4, num_kv_heads=2, max_positions=64)


def _full_state(seed: int = 3) -> dict[str, torch.Tensor]:
    from restage.models.sharding import param_specs

    gen = torch.Generator().manual_seed(seed)
    return {s.name: (torch.ones(s.shape) if s.name.endswith("norm.weight") else torch.randn(s.shape, generator=gen))
            for s in param_specs(CFG)}


def _module(layout: Layout, groups: ProcessGroups | None, rank: int, full: dict[str, torch.Tensor]):
    from restage.models.decoder import StageModule
    from restage.models.parallel import ParallelContext
    from restage.models.sharding import shard_specs

    ctx = ParallelContext.from_layout(layout, groups, rank)
    shard = {s.param.name: full[s.param.name][s.index()].clone()
             for s in shard_specs(CFG, layout.strategy, ctx.pp_stage, ctx.tp_rank)}
    module = StageModule(CFG, ctx, torch.float32, torch.device("cpu"))
    module.load_state_dict(shard, strict=True)
    return module.eval()


def _stage_bytes(layout: Layout, rank: int) -> int:
    """fp32 bytes of the shard ``rank`` holds in ``layout`` (``sharding.shard_specs``)."""
    from restage.models.sharding import shard_specs

    coord = layout.coord(rank)
    return sum(s.numel for s in shard_specs(CFG, layout.strategy, coord.pp, coord.tp)) * 4


def choose_prompts(reference, replicas: int) -> tuple[int, list[list[list[int]]]]:
    """(EOS id, each replica's prompts): replica 0's answers end at EOS on their first token, the others' never do."""
    from restage.rollout.generation import generate

    gen = torch.Generator().manual_seed(11)
    candidates = [torch.randint(1, CFG.vocab_size, (int(n),), generator=gen).tolist()
                  for n in torch.randint(3, 7, (200,), generator=gen)]
    answers = generate(reference, candidates, SamplingParams(max_new_tokens=CAP, greedy=True, eos_token_ids=())).sequences()
    firsts = [a[0] for a in answers]
    eos = max(set(firsts), key=firsts.count)  # the most common first token: many prompts stop at once
    stopping = [p for p, a in zip(candidates, answers) if a[0] == eos]
    running = [p for p, a in zip(candidates, answers) if eos not in a]
    need = PER_REPLICA * (replicas - 1)
    assert len(stopping) >= PER_REPLICA and len(running) >= need, (len(stopping), len(running))
    return eos, [stopping[:PER_REPLICA]] + [running[i * PER_REPLICA:(i + 1) * PER_REPLICA] for i in range(replicas - 1)]


def _generate_in_place(rank: int, world_size: int, dp: int, tp: int, mode: str | None) -> dict:
    from restage.config.sections import ModelSpec, OptimConfig
    from restage.models.parallel import ParallelContext
    from restage.rollout.generation import generate
    from restage.runtime.store import zero3_generation
    from restage.runtime.store.zero_engines import build_engine

    layout = Layout(tuple(range(world_size)), Strategy(dp=dp, tp=tp))
    groups = ProcessGroups(layout.all_groups(), singletons=True, timeout_seconds=60)
    full = _full_state()
    reference = _module(Layout((rank,), Strategy()), None, rank, full)
    eos, prompts = choose_prompts(reference, dp)
    mine = prompts[layout.coord(rank).dp]
    params = SamplingParams(max_new_tokens=CAP, greedy=True, eos_token_ids=(eos,))
    expected = generate(reference, mine, params)

    spec = ModelSpec(path="-", trainable=True, zero_stage=3, optim=OptimConfig(lr=0.1))
    engine = build_engine(_module(layout, groups, rank, full), spec, layout, rank, groups, micro_batches=1,
                          total_optimizer_steps=1)
    module = engine.module
    assert all(hasattr(p, "ds_status") for p in module.parameters())  # ZeRO-3's parameters
    gathered_each_forward = sum(not p.ds_persist for p in module.parameters())
    gathered = zero3_generation.gathered_bytes(module)
    forwards = [0]
    hook = module.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    with zero3_generation.generation_module(module, layout, groups, mode) as used:
        got = generate(used, mine, params)
        partitioned_run = any(hasattr(p, "ds_status") for p in used.parameters())
    hook.remove()
    # After the call the engine's parameters are partitioned again (the copy is gone).
    released = all(p.ds_persist or p.data.numel() == 0 for p in module.parameters())
    return dict(
        dp=ParallelContext.from_layout(layout, groups, rank).coord.dp, eos=eos,
        lengths=got.lengths.tolist(), expected_lengths=expected.lengths.tolist(),
        tokens_equal=torch.equal(got.tokens, expected.tokens),
        logprob_gap=float((got.logprobs - expected.logprobs).abs().max()),
        gathered_bytes=gathered, stage_bytes=_stage_bytes(layout, rank), forwards=forwards[0],
        gathered_each_forward=gathered_each_forward,
        partitioned_run=partitioned_run, released=released,
    )


DEFAULT = [pytest.param(2, 1, id="dp2")]
SCALE = [pytest.param(dp, tp, id=f"dp{dp}tp{tp}", marks=pytest.mark.scale) for dp, tp in ((4, 1), (8, 1), (4, 2))]


# None: the runtime's choice (``choose_mode``), which gathers once here: a stage of about 3 MB against the host's memory.
@pytest.mark.parametrize("mode", ["lockstep", None], ids=["lockstep", "chosen-gather-once"])
@pytest.mark.parametrize(("dp", "tp"), DEFAULT + SCALE)
def test_zero3_generation_in_place_with_uneven_answers_matches_one_rank(dp, tp, mode):
    results = spawn(_generate_in_place, dp * tp, dp, tp, mode, env={"DS_ACCELERATOR": "cpu"}, timeout_seconds=240)
    for r in results:
        # The case is what it claims: replica 0 stops at once, the others run to the cap.
        assert r["expected_lengths"] == ([1] * PER_REPLICA if r["dp"] == 0 else [CAP] * PER_REPLICA), r
        assert r["lengths"] == r["expected_lengths"] and r["tokens_equal"], r
        assert r["logprob_gap"] <= 1e-5, r  # fp32; the same prompts batched alike on one rank
        assert r["partitioned_run"] == (mode == "lockstep") and r["released"], r
        assert r["gathered_each_forward"] == 3 * CFG.num_layers, r  # gate, up, down of each layer
        assert r["gathered_bytes"] == r["stage_bytes"], r  # a fresh engine holds none whole: the copy adds the stage
    forwards = {r["forwards"] for r in results}
    if mode == "lockstep":
        # Every rank ran the same forwards (the stopping replica joined), at least one prefill and CAP decode steps.
        assert len(forwards) == 1 and forwards.pop() >= 1 + CAP, results
    else:
        assert forwards == {0}, results  # the partitioned module never ran: the gathered copy did
