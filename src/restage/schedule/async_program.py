"""The per-iteration program of asynchronous training (``plan.execution: async``; docs/runtime.md, "Asynchronous
training").

The trained actor's generate MFCs (the *producers*: ``actor_gen``, ReMax's ``actor_greedy_gen``) run on ranks of
their own and work ahead of training; every other MFC (the *consumers*) trains or infers on batches the producers
made earlier, taken from a rollout buffer on the producers' ranks. Step ``s`` of the program, in the order every
rank walks it:

1. ``push``: when ``s % push_every == 0`` (and on a rank's first step), the actor's weights go from its home
   (the training layout) into its generation copy, shard to shard by reallocation; the copy keeps them, version
   ``s``, until the next push (it is never freed, so generation reads it in later steps).
2. ``generate`` (warm-up): each producer answers the prompts of the steps ``s .. s + ahead - 1`` the buffer lacks:
   all of them at the first step (and after a resume that found no buffer), none later.
3. ``take``: the buffer's batch of step ``s`` becomes the producer's output of this step.
4. the producers' outputs go to their consumers (``transfer``), all before step 5, so the producers' ranks are
   free to generate while the consumers work.
5. ``generate``: each producer answers step ``s + ahead``'s prompts (buffered).
6. the consumers' MFCs, as the synchronous program runs them (``program.build_program``'s walk).

With ``ahead = staleness - push_every + 1`` a token trained at step (version) ``t`` was generated at step
``t - ahead`` or later by weights pushed at most ``push_every - 1`` steps before that: its version gap is at most
``ahead + push_every - 1 = staleness``. Producers and the consumers of the same model must use disjoint ranks:
the generation copy is the weights of an older version, apart from the training shards.

Partial rollouts (``plan.partial_rollouts``): step 5's generate finishes step ``s + ahead``'s batch, begun at step
``s - 1``, and begins step ``s + ahead + 1``'s in the slots it frees (``Generate.partial``); the answers left
unfinished continue at step ``s + 1`` under the weights pushed then. A token of the batch trained at ``t`` was
generated at step ``t - ahead - 1`` or later, by weights pushed at most ``push_every - 1`` steps before: its gap is
at most ``ahead + push_every``, so ``ahead = staleness - push_every`` (>= 1: the batch of step ``s`` is taken
before step 5 runs, so the generate of step ``s`` cannot be finishing it).
"""

from __future__ import annotations

from restage.errors import ConfigError
from restage.graph import MFC, DataflowGraph, MFCKind
from restage.layout import Layout
from restage.schedule.ops import Generate, Op, Push, SendKey, TakeBuffered
from restage.schedule.program import model_homes, union_ranks, walk


def lookahead(staleness: int, push_every: int, partial: bool = False) -> int:
    """Steps generation runs ahead of training: the buffer's depth (one less with partial rollouts)."""
    return staleness - push_every + (0 if partial else 1)


def steps_drawn_ahead(staleness: int, push_every: int, partial: bool = False) -> int:
    """Steps past the current one whose sample ids the generating ranks need: the batch generated, and with partial
    rollouts the one begun behind it."""
    return lookahead(staleness, push_every, partial) + (1 if partial else 0)


def producers(graph: DataflowGraph) -> list[MFC]:
    """The generate MFCs of trained models: they run ahead of training in async mode."""
    trained = set(graph.trained_models())
    return [mfc for mfc in graph if mfc.kind is MFCKind.GENERATE and mfc.model in trained]


def async_layout_problem(graph: DataflowGraph, layouts: dict[str, Layout]) -> str | None:
    """Why these layouts cannot run async mode (a producer sharing ranks with another MFC of its model), or None."""
    ahead = producers(graph)
    if not ahead:
        return "no generate MFC of a trained model to run ahead; set plan.execution=sync"
    for gen in ahead:
        mesh = set(layouts[gen.name].mesh)
        for mfc in graph:
            if mfc.model == gen.model and mfc not in ahead and mesh & set(layouts[mfc.name].mesh):
                return (f"{gen.name} runs on ranks {sorted(mesh)}, which {mfc.name} also uses ({layouts[mfc.name]}); "
                        f"generation needs ranks of its own (e.g. plan.layouts.{gen.name}='ranks:1-1 dp1' beside "
                        "the others on ranks:0-0), or set plan.execution=sync")
    return None


def check_async_layouts(graph: DataflowGraph, layouts: dict[str, Layout]) -> None:
    """ConfigError (one line) when ``async_layout_problem`` finds one."""
    if (problem := async_layout_problem(graph, layouts)) is not None:
        raise ConfigError(f"plan.execution async: {problem}")


def build_async_program(graph: DataflowGraph, layouts: dict[str, Layout], staleness: int, push_every: int,
                        offload_idle: frozenset[str] = frozenset(), resident: frozenset[str] = frozenset(),
                        partial: bool = False) -> list[Op]:
    """The ops of one async iteration, in the order every rank walks them (module docstring)."""
    check_async_layouts(graph, layouts)
    ahead = lookahead(staleness, push_every, partial)
    if ahead < 1:
        raise ConfigError(f"plan.partial_rollouts: needs plan.staleness >= plan.push_every + 1, got staleness="
                          f"{staleness} push_every={push_every}; raise plan.staleness or set "
                          "plan.partial_rollouts=false")
    gens = producers(graph)
    homes = model_homes(graph, layouts)
    ops: list[Op] = []
    for model in dict.fromkeys(g.model for g in gens):
        home = homes[model]
        for layout in dict.fromkeys(layouts[g.name] for g in gens if g.model == model):
            ops.append(Push(union_ranks(home, layout), model, home, layout, push_every))
    for gen in gens:
        ops.append(Generate(layouts[gen.name].mesh, gen.name, gen.model, layouts[gen.name], 0, ahead))
    for gen in gens:
        ops.append(TakeBuffered(layouts[gen.name].mesh, gen.name, layouts[gen.name]))
    names = {g.name for g in gens}
    consumers = [mfc for mfc in graph if mfc.name not in names]
    for mfc in consumers:  # every producer output first: the producers' ranks then generate while consumers work
        for key in mfc.inputs:
            producer = graph.producer(key)
            if producer is not None and producer.name in names:
                src, dst = layouts[producer.name], layouts[mfc.name]
                ops.append(SendKey(union_ranks(src, dst), mfc.name, key, producer.name, src, dst))
    for gen in gens:
        ops.append(Generate(layouts[gen.name].mesh, gen.name, gen.model, layouts[gen.name], ahead, ahead + 1, partial))
    ops += walk(graph, consumers, layouts, offload_idle, resident)
    return ops
