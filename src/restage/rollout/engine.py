"""The rollout engine: continuous batching over a KV cache, one prefill per prompt group.

The cache (``budget.new_rollout_cache``: contiguous rows, or blocks from a pool in ``paged_cache.py``) has a row
per slot; the engine owns the slot table (``slots.SlotTable``: which request holds each slot, its length and
answer step) and builds each forward's attention metadata (``attention.Prefill``: the cache rows a prefill
writes; ``attention.Decode``: the rows, positions and span of a decode step) from it, once per step. The cache
only stores keys and values; the decoder reads the metadata it is handed.

Requests wait in a queue that may be longer than the slots. A request takes a free slot with its
prompt minus the last token already in the cache: the prompt is prefilled once per group (GRPO,
RLOO, best-of-n) and its keys/values copied into the siblings' slots (a paged cache shares the full blocks
instead). The last prompt token is each sample's first decode input, so every sample draws its first answer
token from its own noise. When a paged cache's pool runs out, its newest request is preempted (``_preempt``)
and recomputed later.

No host sync inside the decode loop: the host knows every slot's length and answer position
(both grow by one per step) and retires a request at its max length by itself; only EOS is seen
on the device alone. Every ``check_every_steps`` steps one ``tolist`` reads the slots' alive
flags, finished requests leave and waiting ones take their slots. Replicas that must run the same forwards
(``lockstep.py``: ep, ZeRO-3 partitioned) step in lockstep, joining their peers' forwards when idle.

A decode step reads only static buffers (``next_tokens``, the cache, the slot keys, and a staging
buffer the host copies each slot's position, step and output row into) over the first ``bound`` slots,
``bound`` rounded up to a power of two; on CUDA it is captured once per bucket as a CUDA graph and
replayed (``decode_graphs.py``).

Under pp, ``run`` steps all slots through the stages one after another (``pp_groups=1``); by
default ``generate`` runs the slots as micro-groups in flight through the stages at once
(``pipelined.py``), built from the same engine calls: slot groups, admission, staging, choice and record.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch
import torch.distributed as dist

from restage.errors import ConfigError
from restage.models.attention import AttentionMetadata, Decode, KVStore, Prefill
from restage.models.decoder import StageModule
from restage.models.packing import PackedBatch, pack
from restage.models.pipeline import recv_tensor, send_tensor
from restage.rollout.budget import RolloutLimits, group_count, new_rollout_cache
from restage.rollout.decode_graphs import DecodeGraphs, DecodeMode, choose_decode_mode, mode_traits
from restage.rollout.lockstep import is_partitioned, join_step, lockstep_group, peers_done
from restage.rollout.sampling import SamplingParams, SlotSampler
from restage.rollout.slots import Admission, SlotGroup, SlotTable, bucket, slot_groups


def _stage_step(module: StageModule, inputs: torch.Tensor, batch: PackedBatch, cache: KVStore,
                attn: AttentionMetadata, select: torch.Tensor | None) -> torch.Tensor | None:
    """One forward of this stage inside a pipeline run stage after stage; the last stage returns its logits slice."""
    ctx = module.ctx
    if not ctx.is_first_stage:
        buffer = torch.empty(batch.num_tokens, module.cfg.hidden_size, dtype=module.dtype, device=inputs.device)
        inputs = recv_tensor(buffer, ctx.prev_rank)
    out: torch.Tensor = module(inputs, batch, cache=cache, select=select, attn=attn)
    if not ctx.is_last_stage:
        send_tensor(out, ctx.next_rank)
        return None
    return out


class RolloutEngine:
    """Runs ``requests`` (prompt index, max new tokens, noise key) over ``num_slots`` cache slots.

    Partial rollouts (``generation.continue_generate``): request r's prompt may end with ``started[r]`` answer
    tokens chosen earlier (by older weights); it is prefilled whole, like any prompt, and decodes on from answer
    position ``started[r]``, so its noise continues where it stopped. With ``must_finish`` = M, ``run`` stops as
    soon as requests ``0 .. M-1`` are all done (at the check that sees the last EOS, or at once when the last
    leaves at its max length), leaving the later ones in their slots (their answers so far in the outputs) or
    waiting; the cache then holds at most M slots, so later requests start only as the first ones free theirs.
    ``queue``: the requests waiting at the start (default all, in order); ``width``: the outputs' answer columns
    (default the largest ``max_new``)."""

    def __init__(self, module: StageModule, prompts: Sequence[Sequence[int]], prompt_of: Sequence[int],
                 max_new: Sequence[int], keys: torch.Tensor, params: SamplingParams, eos_ids: Sequence[int],
                 limits: RolloutLimits, decode_mode: DecodeMode | None = None, started: Sequence[int] | None = None,
                 must_finish: int | None = None, max_len: int | None = None, queue: Sequence[int] | None = None,
                 width: int | None = None):
        self.module, self.prompts, self.prompt_of, self.max_new = module, prompts, list(prompt_of), list(max_new)
        self.params, self.limits = params, limits
        self.device = device = next(module.parameters()).device
        requests = len(self.prompt_of)
        self.started = list(started) if started is not None else [0] * requests
        self.must_finish = must_finish if must_finish is not None else requests
        width = width if width is not None else max(self.max_new, default=1)  # the outputs' answer columns
        if max_len is None:  # a slot's length: the longest prompt + answer (TurnEngine gives its episodes')
            max_len = max((len(prompts[p]) + m - s for p, m, s in zip(self.prompt_of, self.max_new, self.started)),
                          default=1)
        ctx, cfg = module.ctx, module.cfg
        self.num_groups = group_count(limits.pp_groups, ctx.pp_size)
        self.cache = new_rollout_cache(module, self.must_finish, max_len, limits, self.num_groups)
        self.num_slots = slots = self.cache.num_rows if self.cache is not None else 0
        self.queue = deque(queue if queue is not None else range(requests))  # waiting, first served first
        self.slots = SlotTable(slots)  # which request holds each slot (host bookkeeping, exact)
        self.preempted = 0  # requests preempted (their blocks given back, put back in the queue, recomputed)
        # Device state per slot, and the outputs (one spare row takes the free slots' writes).
        self.next_tokens = torch.zeros(slots, dtype=torch.int64, device=device)
        self.alive = torch.zeros(slots, dtype=torch.bool, device=device)
        self.slot_keys = torch.zeros(slots, dtype=torch.int64, device=device)
        self.keys = keys.to(device)
        self.sampler = SlotSampler(ctx, cfg.vocab_size, params, eos_ids, device)
        self.tokens = torch.full((requests + 1, width), params.pad_token_id, dtype=torch.int64, device=device)
        self.logprobs = torch.zeros(requests + 1, width, dtype=torch.float32, device=device)
        self.lengths = torch.tensor(self.started + [0], dtype=torch.int64, device=device)
        self.whole = SlotGroup(0, slots)
        self.lockstep = lockstep_group(module)  # None: this replica steps on its own
        # decode_mode None: CUDA graphs where they serve (decode_graphs.choose_decode_mode), else eager.
        self.decode_mode: DecodeMode
        if decode_mode is not None:
            self.decode_mode, self.decode_reason = decode_mode, "asked for"
        else:
            self.decode_mode, self.decode_reason = choose_decode_mode(
                device, enabled=params.cuda_graphs, tp_size=ctx.tp_size, pp_size=ctx.pp_size, ep_size=ctx.ep_size,
                sparse=any(cfg.is_sparse(i) for i in range(*module.layer_range)),
                partitioned=is_partitioned(module),
                tp_backend=str(dist.get_backend(ctx.tp_group)) if ctx.tp_size > 1 else "nccl",
                micro_groups=self.num_groups)
        if self.num_groups == 1 and ctx.pp_size > 1 and mode_traits(self.decode_mode)[0]:
            raise ConfigError("CUDA-graph decode under pp > 1 needs micro-groups in flight (pipelined.py): leave "
                              "pp_groups unset or at least pp, or use decode_mode='eager' with pp_groups=1")
        self.graphs = DecodeGraphs(slots, device, self.decode_mode)

    def run(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Generate every request (up to ``must_finish``): ``(tokens [R, W], logprobs [R, W], lengths [R])``."""
        lockstep = self.lockstep is not None
        while True:
            self.reap()
            if peers_done(self.required_done(), self.lockstep, self.device):
                break
            self._admit(join_if_empty=lockstep)
            for _ in range(self.limits.check_every_steps):
                if not lockstep and self.queue and self.has_free():
                    self._admit(join_if_empty=False)  # a request left at its max length: no sync needed
                if self.bound():
                    self._decode()
                    if not lockstep and self.must_finish < len(self.prompt_of) and self.required_done():
                        break  # the last required request left at its max length: the host knows, no check needed
                elif lockstep:
                    join_step(self.module)
                else:
                    break
        return self.tokens[:-1], self.logprobs[:-1], self.lengths[:-1]

    def required_done(self) -> bool:
        """Whether requests ``0 .. must_finish - 1`` are all done (the queue serves them first)."""
        if self.must_finish == len(self.prompt_of):
            return not self.queue and self.bound() == 0
        return (not self.queue or self.queue[0] >= self.must_finish) and all(
            r >= self.must_finish for r in self.slots.requests())

    def unfinished(self) -> list[int]:
        """Requests still decoding in a slot (their answers so far in the outputs) or waiting, in request order."""
        return sorted(self.slots.requests() + list(self.queue))

    # ---- the slot table, read ------------------------------------------------------------------------------
    def bound(self, group: SlotGroup | None = None) -> int:
        """Slots a decode step of ``group`` (default: all) runs over from its first: past its last busy one, to a power of 2."""
        return self.slots.bound(group if group is not None else self.whole)

    def busy(self, group: SlotGroup) -> bool:
        """Whether a request holds a slot of ``group``."""
        return self.slots.any_busy(group)

    def has_free(self, group: SlotGroup | None = None) -> bool:
        """Whether ``group`` (default: all) has a free slot."""
        return self.slots.any_free(group if group is not None else self.whole)

    def requests_in_slots(self) -> list[int]:
        """The requests holding slots, in slot order."""
        return self.slots.requests()

    # ---- requests leave ------------------------------------------------------------------------------------
    def _retire(self, slots: list[int]) -> None:
        cache = self._cache()
        for i in slots:
            self.slots.vacate(i)
            cache.release(i)
        if slots:
            self.alive.index_fill_(0, torch.tensor(slots).to(self.device, non_blocking=True), False)

    def reap(self, group: SlotGroup | None = None) -> None:
        """The check: one read of the alive flags; requests that stopped at EOS leave their slots."""
        group = group if group is not None else self.whole
        bound = self.bound(group)
        if bound:
            alive = self.alive[group.start:group.start + bound].tolist()  # the one host sync per check
            self._retire([group.start + i for i in range(bound)
                          if self.slots[group.start + i] is not None and not alive[i]])
        if not self.queue:
            self._compact(group)

    def _compact(self, group: SlotGroup) -> None:
        """Move the requests left in high slots of ``group`` down into its free low ones when that shrinks its bound.

        Nothing waits, so no admission will fill the holes; one copy of a request's cache rows is
        cheaper than decoding the empty slots below it for the rest of its answer.
        """
        busy = self.slots.busy(group)
        if bucket(len(busy), group.size) >= self.bound(group):
            return
        cache = self._cache()
        edge = group.start + len(busy)
        high = [i for i in busy if i >= edge]
        low = [i for i in range(group.start, edge) if self.slots[i] is None]
        for source, target in zip(high, low):
            occupant = self.slots[source]
            assert occupant is not None
            cache.move(source, target, occupant.length)
            self.slots.move(source, target)
        sources, targets = (torch.tensor(x).to(self.device, non_blocking=True) for x in (high, low))
        for state in (self.next_tokens, self.alive, self.slot_keys):
            state.index_copy_(0, targets, state.index_select(0, sources))
        self.alive.index_fill_(0, sources, False)

    def _preempt(self, slot: int) -> None:
        """Put ``slot``'s request back at the head of the queue, its blocks given back and its answer so far
        dropped: it is recomputed from its prompt when it gets a slot again (its noise is keyed by request and
        step, so it draws the same tokens)."""
        request = self.slots.vacate(slot).request
        started = self.started[request]
        self._cache().release(slot)
        self.alive[slot] = False
        self.tokens[request, started:] = self.params.pad_token_id
        self.logprobs[request, started:] = 0.0
        self.lengths[request] = started
        self.queue.appendleft(request)  # it was admitted before everything waiting
        self.preempted += 1

    # ---- requests arrive -----------------------------------------------------------------------------------
    def _admit(self, join_if_empty: bool) -> None:
        """Waiting requests take the free slots; each new prompt is prefilled once, its siblings copy it."""
        admission = self.take_slots(self.whole)
        if admission.slots:
            self._prefill(admission.slots, admission.prefixes)
        elif join_if_empty:
            join_step(self.module)
        self.copy_prefixes(admission)

    def take_slots(self, group: SlotGroup) -> Admission:
        """Waiting requests take the free slots of ``group`` (host state and the slots' device state)."""
        assert self.cache is not None or not self.queue  # slots exist when requests do
        holder: dict[int, int] = {}  # prompt -> the last slot holding it
        for i in range(len(self.slots)):
            request = self.slots.request(i)
            if request is not None:
                holder[self.prompt_of[request]] = i
        fresh: dict[int, int] = {}  # prompt -> the slot it is prefilled into now
        copies: dict[tuple[int, int], list[int]] = {}  # (source slot, tokens) -> target slots
        taken: list[int] = []  # the slots taken now
        for slot in self.slots.free(group):
            if not self.queue:
                break
            request = self.queue[0]
            prompt = self.prompt_of[request]
            prefix = len(self.prompts[prompt]) - 1
            source = fresh.get(prompt, holder.get(prompt)) if prefix else None
            # Room for the prompt and the first answer token's keys (a sibling shares its prompt's full blocks);
            # without it the queue waits, first come first served, until a request leaves.
            if not self._cache().hold(slot, prefix + 1, source, prefix):
                break
            self.queue.popleft()
            taken.append(slot)
            self.slots.admit(slot, request, prefix, self.started[request])
            if prefix == 0:
                continue
            if prompt in fresh or prompt in holder:
                copies.setdefault((fresh[prompt] if prompt in fresh else holder[prompt], prefix), []).append(slot)
            else:
                fresh[prompt] = slot
            holder.setdefault(prompt, slot)
        if taken:
            index = torch.tensor(taken).to(self.device, non_blocking=True)
            requests = [self.slots.request(i) for i in taken]
            last = torch.tensor([self.prompts[self.prompt_of[r]][-1] for r in requests if r is not None])
            self.next_tokens.index_copy_(0, index, last.to(self.device, non_blocking=True))
            self.alive.index_fill_(0, index, True)
            self.slot_keys.index_copy_(0, index, self.keys.index_select(
                0, torch.tensor(requests).to(self.device, non_blocking=True)))
        return Admission(list(fresh.values()), [self.prompts[p][:-1] for p in fresh], copies)

    def copy_prefixes(self, admission: Admission) -> None:
        """After the prefill of ``admission``: the siblings' slots copy their prompt's keys/values."""
        for (source, tokens), targets in admission.copies.items():  # one copy per cache tensor for all of a prompt's siblings
            self._cache().copy_prefix(source, targets, tokens)

    def prefill_forward(self, slots: list[int], inputs: torch.Tensor, batch: PackedBatch, *,
                        relay: bool = True) -> torch.Tensor | None:
        """Prefill ``batch`` (one sequence per slot) into the cache rows of ``slots``; returns the stage's output
        (None from a stage that sent it on). ``relay``: receive the inputs from the previous stage and send the
        output to the next (the stages one after another); False: this stage alone (``pipelined.py`` moves
        activations itself)."""
        cache = self._cache()
        cache.flush()
        attn = Prefill(rows=torch.tensor(slots).to(self.device, non_blocking=True))
        select = torch.empty(0, dtype=torch.int64, device=self.device)
        if relay:
            return _stage_step(self.module, inputs, batch, cache, attn, select)
        out: torch.Tensor = self.module(inputs, batch, cache=cache, select=select, attn=attn)
        return out

    def _prefill(self, slots: list[int], prefixes: list[Sequence[int]]) -> None:
        self.prefill_forward(slots, *pack(prefixes, device=self.device))

    # ---- decode steps --------------------------------------------------------------------------------------
    def host_rows(self, group: SlotGroup, bound: int) -> torch.Tensor:
        """Give ``group``'s first ``bound`` slots room for a decode step; their ``stage_inputs`` rows."""
        self._grow(group.start, group.start + bound)
        return self.slots.stage_rows(group.start, bound, len(self.tokens) - 1)

    def _grow(self, lo: int, hi: int) -> None:
        """Give slots ``lo .. hi - 1`` room for this step's keys; where a pool runs out, preempt its newest request
        (vLLM's rule: the oldest always progress) until there is room or the slot itself was the newest."""
        cache = self._cache()
        for i in range(lo, hi):
            while (occupant := self.slots[i]) is not None and not cache.hold(i, occupant.length + 1):
                self._preempt(self.slots.newest(self.cache_pool(i)))
        cache.flush()

    def cache_pool(self, slot: int) -> range:
        """The slots whose cache rows share ``slot``'s block pool (the whole engine, or its pipelined micro-group)."""
        if self.num_groups == 1:
            return range(self.num_slots)
        return next(range(g.start, g.stop) for g in slot_groups(self.num_slots, self.num_groups)
                    if g.start <= slot < g.stop)

    def decode_metadata(self, first_row: int, positions: torch.Tensor) -> Decode:
        """A decode step's attention metadata for slots ``first_row ..`` at ``positions`` (a view of the staging
        buffer). A graph replays one shape per bucket: attention then spans every cache position, masked."""
        longest = (self._cache().max_len - 1 if self.graphs.fixed_span
                   else self.slots.longest(first_row, first_row + positions.shape[0]))
        return Decode(positions, longest, first_row)

    def stage_group(self, group: SlotGroup, bound: int) -> torch.Tensor:
        """Set up a decode step of ``group``'s first ``bound`` slots (eager); returns their staged rows."""
        staged = self.graphs.staged[:, group.start:group.start + bound]
        staged.copy_(self.host_rows(group, bound), non_blocking=True)
        return staged

    def decode_group(self, group: SlotGroup, bound: int, hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode forward of this stage alone over ``group``'s first ``bound`` slots (``hidden``: the previous
        stage's output, None on the first stage); returns the staged rows and the stage's output."""
        staged = self.stage_group(group, bound)
        inputs = self.next_tokens[group.start:group.start + bound] if hidden is None else hidden
        out: torch.Tensor = self.module(inputs, PackedBatch.decode_step(staged[0]), cache=self._cache(),
                                        attn=self.decode_metadata(group.start, staged[0]))
        return staged, out

    def advance(self, group: SlotGroup, bound: int) -> None:
        """Host side of a decode step over ``group``'s first ``bound`` slots: one token longer; retire at max length."""
        self._retire(self.slots.advance(group.start, bound, self.max_new))

    def _decode(self) -> None:
        """One token for every slot below the bound (free slots compute into their own unused rows)."""
        bound = self.bound()
        self.graphs.run(bound, self.host_rows(self.whole, bound), self._decode_step)
        self.advance(self.whole, bound)

    def _decode_step(self, bound: int, staged: torch.Tensor) -> None:
        """The device half of a decode step; it reads and writes only static buffers (a CUDA graph replays it)."""
        positions, steps, _ = staged.unbind(0)  # views of the staging buffer: position, answer step, output row
        logits = _stage_step(self.module, self.next_tokens[:bound], PackedBatch.decode_step(positions), self._cache(),
                             self.decode_metadata(0, positions), None)
        tokens, logprobs = self.choose(logits, 0, staged)
        self.sampler.share(tokens, logprobs)
        self.record(0, staged, tokens, logprobs)

    def choose(self, logits: torch.Tensor | None, start: int, staged: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The last stage's tokens and log-probs for slots ``start ..`` (zeros elsewhere, to be overwritten)."""
        return self.sampler.choose(logits, self.slot_keys[start:start + staged.shape[1]], staged[1])

    def record(self, start: int, staged: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Write a decode step's chosen tokens of slots ``start ..`` into the outputs and the slots' state."""
        _, steps, rows = staged.unbind(0)
        bound = staged.shape[1]
        pad = self.params.pad_token_id
        alive = self.alive[start:start + bound]
        self.tokens[rows, steps] = torch.where(alive, tokens, pad)
        self.logprobs[rows, steps] = torch.where(alive, logprobs, 0.0)
        self.lengths.index_add_(0, rows, alive.long())
        alive &= ~self.sampler.is_eos[tokens]
        self.next_tokens[start:start + bound] = tokens

    def _cache(self) -> KVStore:
        assert self.cache is not None  # slots exist when requests do
        return self.cache
