"""Pipeline-parallel rollout without the (pp-1)/pp bubble: micro-groups of slots in flight through the stages.

Stepping all slots through the stages one after another (``RolloutEngine.run``) keeps one stage
busy at a time. Here the engine's slots are split into ``G >= pp`` consecutive micro-groups
(``RolloutLimits.pp_groups``, default ``pp``) and every rank walks one sequence of *events*:
event ``e`` belongs to group ``e % G`` and is its ``e // G``-th step. Stage ``s`` handles event
``e`` at tick ``e + s``, so at every tick the ``pp`` stages work on ``pp`` different groups; in the
steady state no stage waits for another.

What a stage does at tick ``t`` (handling event ``e = t - s`` of group ``g``):

1. Deliver event ``t - pp``: its tokens, chosen by the last stage at tick ``t - 1``, reach every
   stage in one broadcast over the pp group (tokens and log-probs in one float64 message: both
   convert exactly); each stage records them into the outputs and the slots' state. Group ``g``'s
   previous step is event ``e - G <= t - pp``, so its tokens are in before its next step.
2. The host part of event ``e``, the same on every stage of the replica (all of them hold the same
   host state and see the events in the same order): the previous step of ``g`` advances the
   slots' lengths and retires requests at their max length; every ``k``-th step of ``g``
   (``check_every_steps``) is its check: one read of ``g``'s alive flags, EOS-finished requests
   leave (and with nothing waiting, ``g``'s requests compact into its low slots). Waiting requests
   take ``g``'s free slots at its check, and between checks whenever a slot was freed at max length.
   A new prompt is prefilled once; a sibling in any group copies its prefix from the slot that
   holds it (that slot's rows were written at an earlier event, so on this stage already).
3. One batched send/recv with the neighbouring stages: this stage's outputs of tick ``t - 1``
   (event ``e - 1``: prefill hidden states, then decode hidden states) go to the next stage, and
   event ``e``'s come in from the previous one. Every transfer is stage ``s`` to ``s + 1``, the
   receiver knows the sizes from step 2, and each side posts its ops in the same order, so NCCL's
   blocking send/recv pair up with no cycle; the per-tick broadcast is a collective every stage
   calls at the same tick.
4. The device part: the prefill forward, the prefix copies, and the decode forward over ``g``'s
   first ``bound`` slots (the cache's rows ``g.start ..``); the last stage chooses the tokens.

Stopping: when, after an event's host part, nothing waits and no group holds a request, every
group's latest event was idle, so nothing is in flight; each stage stops at that same event.

Expert parallelism: the replicas of an ep group run the same ticks (same ``G``), so their check
events coincide; at each check a stage prefills or joins the sparse layers' exchange, at each
event it decodes or joins, and "everyone done" is one all-reduce over the ep group per check.
A ZeRO-3 partitioned module's dp replicas do the same over the dp group, their join a one-token
forward (``lockstep.lockstep_group``, ``lockstep.join_step``).

Decode steps over static buffers (``static`` and ``graphs`` modes, ``decode_graphs.py``): each stage's part of a
decode event reads and writes only buffers allocated once per run (``StageBuffers``, each micro-group its own
rows of them, as of the staging buffer and the cache), so on CUDA it is captured once per (micro-group, bucket)
and replayed. The event's order on a stage: the host receives the previous stage's hidden states into the
group's rows of ``StageBuffers.inputs`` (``_exchange``), the step runs (the stage's layers; on the last stage
the LM head, the sampler and the TP broadcast of its choice, written into ``StageBuffers.chosen``; elsewhere the
output written into ``StageBuffers.outputs``), and the next tick's exchange sends those rows on. A group's rows
are written again only at its next event, ``G >= pp`` ticks later, after its send and its tokens' broadcast
(ticks run in order on a stage; NCCL's send waits on the stream the step ran on), so no rows are overwritten
while still being read. The send/recv, the broadcast and the prefill stay outside the graphs (why:
``decode_graphs``'s module doc). On a weight-bandwidth-bound GPU decode a stage's step costs about the same
for ``S / G`` slots as for ``S``, so removing the bubble pays when a group's step is large enough to be
compute-bound, or with more slots: a stage's KV cache per slot holds only its own layers, so the same memory
budget gives ``pp`` times the slots (raise ``max_slots``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from restage.models.packing import PackedBatch, pack
from restage.models.pipeline import P2PKind, p2p
from restage.rollout.engine import RolloutEngine
from restage.rollout.lockstep import join_step, peers_done
from restage.rollout.slots import Admission, SlotGroup, slot_groups


@dataclass(frozen=True)
class Event:
    """The host's decisions for one step of one group; every stage of the replica computes the same."""

    index: int
    group: SlotGroup
    admission: Admission | None  # requests that took slots now (prefill and copies), None: none
    bound: int  # slots decoded, from group.start (0: no decode)
    check: bool  # the group's check: under ep, a prefill or a join of the sparse layers

    @property
    def prefill_tokens(self) -> int:
        return sum(len(p) for p in self.admission.prefixes) if self.admission else 0


class StageBuffers:
    """A stage's static buffers for decode steps a graph replays, a row per slot (a group uses its own rows): the
    hidden states received (``inputs``; not on the first stage, whose inputs are the engine's next tokens), the
    stage's output sent on (``outputs``; not on the last), and the last stage's chosen tokens and log-probs
    (``chosen``, ``[2, slots]`` float64: both convert exactly, as the broadcast sends them)."""

    def __init__(self, engine: RolloutEngine) -> None:
        module, ctx, rows = engine.module, engine.module.ctx, engine.num_slots

        def hidden() -> torch.Tensor:
            return torch.zeros(rows, module.cfg.hidden_size, dtype=module.dtype, device=engine.device)

        self.inputs = None if ctx.is_first_stage else hidden()
        self.outputs = None if ctx.is_last_stage else hidden()
        self.chosen = torch.zeros(2, rows, dtype=torch.float64, device=engine.device) if ctx.is_last_stage else None

    def step(self, engine: RolloutEngine, start: int, bound: int, staged: torch.Tensor) -> None:
        """The device part of a decode event over slots ``start .. start + bound - 1`` (``decode_graphs.StepFn``):
        it reads and writes only static buffers, so a CUDA graph replays it."""
        rows = slice(start, start + bound)
        inputs = engine.next_tokens[rows] if self.inputs is None else self.inputs[rows]
        out = engine.module(inputs, PackedBatch.decode_step(staged[0]), cache=engine.cache,
                            attn=engine.decode_metadata(start, staged[0]))
        if self.outputs is not None:
            self.outputs[rows].copy_(out)
            return
        assert self.chosen is not None  # the last stage
        tokens, logprobs = engine.choose(out, start, staged)
        engine.sampler.share_over_tp(tokens, logprobs)
        self.chosen[0, rows].copy_(tokens)
        self.chosen[1, rows].copy_(logprobs)


@dataclass
class ScheduleLog:
    """What one stage did (the bench's figure): its ticks, those with work, and the slots it decoded at each."""

    ticks: int = 0
    busy_ticks: int = 0
    decoded_slots: list[int] = field(default_factory=list)


class PipelinedRollout:
    """Runs a ``RolloutEngine``'s requests with ``engine.num_groups`` micro-groups in flight (see the module doc)."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine, self.module = engine, engine.module
        self.groups = slot_groups(engine.num_slots, engine.num_groups)
        self.decoded = [0] * len(self.groups)  # bound of each group's latest decode, not yet advanced on the host
        self.staged: dict[int, torch.Tensor] = {}  # event -> its decode's staged rows, until its tokens are recorded
        self.chosen: dict[int, torch.Tensor] = {}  # last stage: event -> [tokens; logprobs] float64, to deliver
        # static/graphs modes: the stage's decode steps over static buffers (None: eager, fresh tensors each event)
        self.buffers = StageBuffers(engine) if engine.graphs.fixed_span else None
        self.log = ScheduleLog()

    def run(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Generate every request: ``(tokens [R, W], logprobs [R, W], lengths [R])``."""
        ctx, engine = self.module.ctx, self.engine
        outbox: list[torch.Tensor] = []
        index = 0
        while True:
            self._deliver(index + ctx.pp_stage - ctx.pp_size)
            event, done = self._plan(index)
            if done:
                assert not outbox and not self.chosen, "a stage stopped with work in flight"
                break
            self.log.ticks += 1
            self.log.busy_ticks += bool(event.prefill_tokens or event.bound)
            self.log.decoded_slots.append(event.bound)
            inputs = self._exchange(outbox, event)
            outbox = self._forward(event, inputs)
            index += 1
        return engine.tokens[:-1], engine.logprobs[:-1], engine.lengths[:-1]

    def _deliver(self, index: int) -> None:
        """Every stage records the tokens the last stage chose for event ``index`` (if it decoded)."""
        staged = self.staged.pop(index, None)
        if staged is None:
            return
        ctx = self.module.ctx
        message = self.chosen.pop(index) if ctx.is_last_stage else torch.empty(
            2, staged.shape[1], dtype=torch.float64, device=self.engine.device)
        if ctx.pp_size > 1:  # pp = 1 runs the same schedule in one process (the CPU tests do)
            dist.broadcast(message, src=ctx.last_stage_rank, group=ctx.pp_group)
        group = self.groups[index % len(self.groups)]
        self.engine.record(group.start, staged, message[0].long(), message[1].float())

    def _plan(self, index: int) -> tuple[Event, bool]:
        """The host part of event ``index``; also whether the whole replica (in lockstep: every replica) is done."""
        engine = self.engine
        lockstep = engine.lockstep is not None
        g = index % len(self.groups)
        group = self.groups[g]
        if self.decoded[g]:
            engine.advance(group, self.decoded[g])
        check = (index // len(self.groups)) % engine.limits.check_every_steps == 0
        if check:
            engine.reap(group)
        admission = None
        if engine.queue and engine.has_free(group) and (check or not lockstep):
            admission = engine.take_slots(group)
        bound = engine.bound(group)
        self.decoded[g] = bound
        idle = not engine.queue and not any(engine.busy(x) for x in self.groups)
        # In lockstep the replicas agree at their (coinciding) checks; an idle replica keeps joining until then.
        done = check and peers_done(idle, engine.lockstep, engine.device) if lockstep else idle
        return Event(index, group, admission, bound, check), done

    def _exchange(self, outbox: list[torch.Tensor], event: Event) -> list[torch.Tensor]:
        """Send last tick's outputs to the next stage and receive this event's inputs from the previous one."""
        module, ctx = self.module, self.module.ctx
        ops: list[tuple[P2PKind, torch.Tensor, int | None]] = [("send", t.contiguous(), ctx.next_rank) for t in outbox]
        inputs: list[torch.Tensor] = []
        if not ctx.is_first_stage:
            if event.prefill_tokens:
                inputs.append(torch.empty(event.prefill_tokens, module.cfg.hidden_size, dtype=module.dtype,
                                          device=self.engine.device))
            if event.bound:
                inputs.append(self._decode_inputs(event))
            ops += [("recv", t, ctx.prev_rank) for t in inputs]
        p2p([(kind, tensor, peer) for kind, tensor, peer in ops if peer is not None])
        return inputs

    def _decode_inputs(self, event: Event) -> torch.Tensor:
        """Where this stage receives the event's decode hidden states: its group's rows of the static buffer, or new."""
        if self.buffers is not None:
            assert self.buffers.inputs is not None  # not the first stage
            return self.buffers.inputs[event.group.start:event.group.start + event.bound]
        module = self.module
        return torch.empty(event.bound, module.cfg.hidden_size, dtype=module.dtype, device=self.engine.device)

    def _forward(self, event: Event, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """This stage's prefill and decode of ``event``; returns what goes to the next stage (nothing from the last)."""
        engine, module, ctx = self.engine, self.module, self.module.ctx
        lockstep = engine.lockstep is not None
        received = iter(inputs)
        outputs = []
        if event.admission is not None and event.admission.slots:
            tokens, batch = pack(event.admission.prefixes, device=engine.device)
            hidden = tokens if ctx.is_first_stage else next(received)
            prefilled = engine.prefill_forward(event.admission.slots, hidden, batch, relay=False)
            assert prefilled is not None  # a stage alone returns its output
            outputs.append(prefilled)
        elif lockstep and event.check:
            join_step(module)
        if event.admission is not None:
            engine.copy_prefixes(event.admission)
        if event.bound:
            if self.buffers is None:
                self._decode_eager(event, None if ctx.is_first_stage else next(received), outputs)
            else:  # its inputs were received into the buffers
                self._decode_static(event, self.buffers, outputs)
        elif lockstep:
            join_step(module)
        return [] if ctx.is_last_stage else outputs

    def _decode_eager(self, event: Event, hidden: torch.Tensor | None, outputs: list[torch.Tensor]) -> None:
        """Event's decode step as plain PyTorch over fresh tensors (the eager mode)."""
        engine, ctx, group = self.engine, self.module.ctx, event.group
        staged, out = engine.decode_group(group, event.bound, hidden)
        self.staged[event.index] = staged
        outputs.append(out)
        if ctx.is_last_stage:
            tokens, logprobs = engine.choose(out, group.start, staged)
            engine.sampler.share_over_tp(tokens, logprobs)
            self.chosen[event.index] = torch.stack([tokens.double(), logprobs.double()])

    def _decode_static(self, event: Event, buffers: StageBuffers, outputs: list[torch.Tensor]) -> None:
        """Event's decode step over ``buffers`` (its inputs already received there): staged, then run or replayed."""
        engine, group, bound = self.engine, event.group, event.bound
        rows = slice(group.start, group.start + bound)
        engine.graphs.run(bound, engine.host_rows(group, bound),
                          lambda b, staged: buffers.step(engine, group.start, b, staged), start=group.start)
        self.staged[event.index] = engine.graphs.staged[:, rows]
        if buffers.outputs is not None:
            outputs.append(buffers.outputs[rows])  # sent at the next tick, before this group's next step
        if buffers.chosen is not None:  # a copy: the pp broadcast at the next tick needs a contiguous tensor
            self.chosen[event.index] = buffers.chosen[:, rows].clone()


def run_pipelined(engine: RolloutEngine) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``engine.run()``'s result with the engine's slots in ``engine.num_groups`` micro-groups through the stages."""
    return PipelinedRollout(engine).run()
