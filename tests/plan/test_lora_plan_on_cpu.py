"""The planner on a LoRA actor: only adapter bytes reallocated, its copies resident, state for adapters only."""

from __future__ import annotations

from restage.algorithms.interface import build_graph
from restage.config.load import config_from_dict
from restage.layout import Layout, Strategy
from restage.models.arch import LoraConfig
from restage.models.sharding import is_adapter, param_specs
from restage.plan.model_state import stage_param_elements, stage_trained_elements
from restage.plan.plan_score import plan_memory
from restage.plan.problem import PlanProblem, roles_from_config
from restage.plan.transfer_cost import exact_realloc, fast_realloc
from restage.schedule.ops import Free
from restage.schedule.program import build_program
from restage.schedule.realloc_plan import destination_shard_bytes, plan_reallocation

LORA = {"rank": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj", "down"]}
TRAIN = Layout.contiguous(0, Strategy(tp=4))
GEN = Layout.contiguous(0, Strategy(dp=4))


def grpo(lora=None, actor="llama-7b"):
    actor_spec = {"arch": actor, "trainable": True, "dtype": "bf16", **({"lora": lora} if lora else {})}
    cfg = config_from_dict({"experiment": "t", "algorithm": "grpo", "reward_fn": "restage.data.tasks:reward",
                            "models": {"actor": actor_spec, "ref": {"arch": actor, "dtype": "bf16"}},
                            "run": {"batch_size": 64}, "cluster": {"name": "h100-80gb"}})
    graph = build_graph(cfg)
    return graph, roles_from_config(cfg, graph)


def test_roles_carry_the_lora_config_with_canonical_targets():
    _, roles = grpo(LORA)
    assert roles["actor"].arch.lora == LoraConfig(16, 32.0, ("q", "v", "down"))
    assert roles["ref"].arch.lora is None


def test_reallocation_cost_counts_only_the_adapters_the_destination_lacks():
    graph, roles = grpo(LORA)
    cfg = roles["actor"].arch
    problem = PlanProblem(graph, roles, _cluster())
    adapters = plan_reallocation(cfg, TRAIN, GEN, bytes_per_element=2, adapters_only=True)
    # Every dp rank of GEN holds all adapters; what it lacks is what TP rank r of TRAIN did not hold.
    lacking = sum(destination_shard_bytes(adapters, r) for r in GEN.mesh) - adapters.local_bytes
    assert adapters.total_bytes == lacking == adapters.lower_bound_bytes > 0
    assert all(is_adapter(cfg, p.name) for p in adapters.pieces)
    problem.exact_realloc = True
    assert problem.realloc("actor", TRAIN, GEN).total_bytes == adapters.total_bytes
    problem.exact_realloc = False
    assert problem.realloc("actor", TRAIN, GEN).total_bytes == adapters.total_bytes
    dense = exact_realloc(cfg, TRAIN, GEN, 2, _cluster())
    assert fast_realloc(cfg, TRAIN, GEN, 2, _cluster()).total_bytes == dense.total_bytes  # the first move: everything
    adapter_elements = sum(s.numel for s in param_specs(cfg) if is_adapter(cfg, s.name))
    assert adapter_elements == 32 * 16 * (2 * 4096 + 2 * 4096 + 4096 + 11008)
    assert adapters.total_bytes < dense.total_bytes / 100


def test_train_state_holds_gradients_and_adam_only_for_adapters():
    graph, roles = grpo(LORA)
    problem = PlanProblem(graph, roles, _cluster())
    est = problem.candidate("actor_train", TRAIN).estimate
    cfg = roles["actor"].arch
    params, trained = max(stage_param_elements(cfg, 4, 1)), max(stage_trained_elements(cfg, 4, 1))
    assert trained < params / 50
    # bf16, ZeRO-1 over one DP rank: parameters, bf16 gradients and 12 bytes of AdamW state per trained element.
    assert est.state_bytes == params * 2 + trained * 2 + trained * 12


def test_lora_copies_stay_resident_in_the_program_and_in_the_memory_plan():
    graph, roles = grpo(LORA)
    layouts = {"actor_gen": GEN, "ref_inf": GEN, "actor_train": TRAIN}
    dense_ops = build_program(graph, layouts)
    lora_ops = build_program(graph, layouts, resident=frozenset({"actor"}))
    assert [op.model for op in dense_ops if isinstance(op, Free)] == ["actor"]
    assert not [op for op in lora_ops if isinstance(op, Free)]
    problem = PlanProblem(graph, roles, _cluster())
    plan = tuple(problem.candidate(m, layouts[m.name]) for m in problem.mfcs)
    _, peaks = plan_memory(problem, plan)
    gen, ref, train = (plan[problem.index[n]].estimate for n in ("actor_gen", "ref_inf", "actor_train"))
    # On the shared ranks, the actor_train peak holds the actor's home state, the ref's and the actor's resident copy.
    assert peaks[problem.index["actor_train"]] == train.state_bytes + ref.state_bytes + gen.param_bytes + \
        train.transient_bytes


def _cluster():
    from restage.cluster import load_cluster

    return load_cluster("h100-80gb", 1, 4)
