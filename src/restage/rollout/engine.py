"""The rollout engine: continuous batching over a KV cache, one prefill per prompt group.

The cache (``new_rollout_cache``) is either contiguous, ``[slots, max_len, H_kv, D]`` per layer with
as many slots as the memory budget holds (``RolloutLimits``), or paged (``paged_cache.py``): the slots'
keys/values in blocks from a pool, taken as answers grow and given back when they end, a group's
prompt blocks held once; when a pool runs out, its newest request is preempted (``_preempt``) and
recomputed later. ``generation.kv_cache=auto`` pages where flash-attn's paged kernel reads the blocks
in place (``flash_pages``); elsewhere a gather per layer and step would cost more than slots waste.

Requests wait in a queue that may be longer than the slots. A request takes a free slot with its
prompt minus the last token already in the cache: the prompt is prefilled once per group (GRPO,
RLOO, best-of-n) and its keys/values copied into the siblings' slots (the compute is shared; the
memory is not, which pages would also share). The last prompt token is each sample's first decode
input, so every sample draws its first answer token from its own noise.

No host sync inside the decode loop: the host knows every slot's length and answer position
(both grow by one per step) and retires a request at its max length by itself; only EOS is seen
on the device alone. Every ``check_every_steps`` steps one ``tolist`` reads the slots' alive
flags, finished requests leave and waiting ones take their slots.

Under expert parallelism the dp replicas of an ep group exchange tokens in their sparse layers,
so they step in lockstep: each round is one check, one prefill forward (or an empty join) and
``check_every_steps`` decode forwards (or joins), until no replica has work left. A module whose
parameters DeepSpeed ZeRO-3 partitions (the actor generating on its training layout, in
``runtime/store/zero3_generation.py``'s lockstep mode) gathers them over its dp group in every forward, so
its dp replicas step in the same lockstep; their join is a forward of one dummy token, whose hooks
gather what a real forward does (``lockstep_group``, ``join_step``).

A decode step reads only static buffers (``next_tokens``, the cache, the slot keys, and a staging
buffer the host copies each slot's position, step and output row into) over the first ``hi`` slots,
``hi`` rounded up to a power of two; on CUDA it is captured once per bucket as a CUDA graph and
replayed (``decode_graphs.py``).

Under pp, ``run`` steps all slots through the stages one after another (``pp_groups=1``); by
default ``generate`` runs the slots as micro-groups in flight through the stages at once
(``rollout_pipeline.py``), built from the same pieces: slot groups, admission, staging, choice
and record.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from restage.errors import ConfigError
from restage.models.attention import CacheState, flash_attn_with_kvcache
from restage.models.decoder import StageModule
from restage.models.moe import MoEMLP
from restage.models.packing import PackedBatch, pack
from restage.models.parallel import gather_from_tp, vocab_sizes
from restage.models.pipeline import recv_tensor, send_tensor
from restage.rollout.decode_graphs import DecodeGraphs, DecodeMode, choose_decode_mode, stage_inputs
from restage.rollout.paged_cache import DEFAULT_BLOCK_TOKENS, FLASH_BLOCK_TOKENS, blocks_for
from restage.rollout.sampling import SamplingParams, choose_tokens


@dataclass(frozen=True)
class RolloutLimits:
    """How big the engine may grow (``generate`` takes the first two from ``generation.kv_cache_gib`` and ``max_slots``)."""

    kv_cache_bytes: int | None = None  # None: 2 GiB on CPU, 40% of the free memory on a GPU
    max_slots: int = 64
    check_every_steps: int = 4  # k: one host sync per k decode steps; a finished request idles < k steps
    # Micro-groups of slots in flight through the pipeline at once (rollout_pipeline.py): None is pp
    # (no bubble), 1 steps all slots through the stages one after another; else at least pp.
    pp_groups: int | None = None
    # The cache's layout (``generation.kv_cache``): blocks from a shared pool (paged_cache.py; concurrency bounded by
    # the tokens held), or a slot of the longest possible sequence per request (contiguous); None (auto): paged where
    # flash-attn's paged kernel reads the blocks in place (``flash_pages``), else contiguous.
    paged: bool | None = None
    block_tokens: int = 0  # a block's positions (``generation.kv_block_tokens``); 0: ``block_tokens_for`` decides

    @classmethod
    def of(cls, kv_cache_gib: float, max_slots: int, paged: bool | None = None,
           block_tokens: int = 0) -> RolloutLimits:
        """The limits ``generation.kv_cache_gib`` (0: sized from free memory), ``max_slots``, ``kv_cache`` (paged or
        not) and ``kv_block_tokens`` set."""
        return cls(kv_cache_bytes=int(kv_cache_gib * (1 << 30)) if kv_cache_gib > 0 else None, max_slots=max_slots,
                   paged=paged, block_tokens=block_tokens)

    @classmethod
    def of_params(cls, params) -> RolloutLimits:
        """``of`` a ``GenerationConfig`` (or the ``SamplingParams`` that extend it)."""
        paged = {"auto": None, "paged": True, "contiguous": False}[params.kv_cache]
        return cls.of(params.kv_cache_gib, params.max_slots, paged, params.kv_block_tokens)


@dataclass(frozen=True)
class SlotGroup:
    """Cache slots ``start .. start + size - 1``, decoded together (all slots, or one pipelined micro-group)."""

    start: int
    size: int

    @property
    def stop(self) -> int:
        return self.start + self.size


def slot_groups(slots: int, count: int) -> list[SlotGroup]:
    """``slots`` split into ``count`` consecutive groups whose sizes differ by at most one."""
    bounds = [g * slots // count for g in range(count + 1)]
    return [SlotGroup(lo, hi - lo) for lo, hi in zip(bounds, bounds[1:])]


@dataclass(frozen=True)
class Admission:
    """Requests that took free slots: the slots prefilled now (one per new prompt) and the prefix copies."""

    slots: list[int]
    prefixes: list[Sequence[int]]
    copies: dict[tuple[int, int], list[int]]  # (source slot, tokens) -> the target slots that copy them


def kv_bytes_per_slot(module: StageModule, max_len: int) -> int:
    """Bytes one slot of this stage's cache takes (keys and values of its layers)."""
    layers = module.layer_range[1] - module.layer_range[0]
    kv_heads = module.cfg.num_kv_heads // module.ctx.tp_size
    return 2 * layers * max_len * kv_heads * module.cfg.head_dim * module.dtype.itemsize


# The KV cache budget when ``RolloutLimits.kv_cache_bytes`` is None (the planner's estimate uses the same figures).
GPU_FREE_MEMORY_FRACTION = 0.4  # of the device memory available when the engine is built (``available_device_bytes``)
CPU_KV_CACHE_BYTES = 2 << 30
# ZeRO-3 generation in place (``runtime/store/zero3_generation.py``, the planner's ``simulator.zero3_generation_mode``):
# the stage's parameters are gathered once for the call when they fit in the share of the available memory that the
# default KV-cache budget leaves (the cache then gets GPU_FREE_MEMORY_FRACTION of what the copy leaves, at least
# 0.4 x 0.4 = 16% of the available memory); else the replicas step in lockstep, one unit gathered at a time.
GATHER_ONCE_FRACTION = 1 - GPU_FREE_MEMORY_FRACTION


def available_device_bytes(free: int, total: int, reserved: int, allocated: int) -> int:
    """Memory this process can still fill on its GPU: the device's free memory (``torch.cuda.mem_get_info``) plus
    what PyTorch's caching allocator holds reserved but not allocated (a training step's cached blocks, which the
    device counts as used), at most ``total``."""
    return max(0, min(total, free + max(0, reserved - allocated)))


def gpu_kv_budget_bytes(free: int, total: int, reserved: int, allocated: int) -> int:
    """The default KV cache budget on a GPU: ``GPU_FREE_MEMORY_FRACTION`` of ``available_device_bytes``, as the
    planner's ``restage_slots`` takes it of the usable memory the rank's weights leave."""
    return int(GPU_FREE_MEMORY_FRACTION * available_device_bytes(free, total, reserved, allocated))


def cuda_available_bytes(device: torch.device) -> int:
    """``available_device_bytes`` of ``device`` (a CUDA device), measured now."""
    free, total = torch.cuda.mem_get_info(device)
    return available_device_bytes(free, total, torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device))


def gathers_once(gathered_bytes: int, available_bytes: int) -> bool:
    """ZeRO-3 generation in place: whether the stage's parameters are gathered once for the call (``gathered_bytes``
    within ``GATHER_ONCE_FRACTION`` of ``available_bytes``) rather than in every forward, the replicas in lockstep."""
    return gathered_bytes <= GATHER_ONCE_FRACTION * available_bytes


def slot_count(budget_bytes: int, slot_bytes: int, num_requests: int, max_slots: int) -> int:
    """Cache slots of ``slot_bytes`` each: as many as ``budget_bytes`` holds, at most ``max_slots`` and the requests
    (0 when the budget holds no slot; ``plan_slots`` refuses that)."""
    return min(max_slots, num_requests, budget_bytes // max(1, slot_bytes))


def kv_budget_bytes(module: StageModule, limits: RolloutLimits) -> int:
    """The bytes this stage's KV cache may take: ``limits.kv_cache_bytes``, or the default budget."""
    if limits.kv_cache_bytes is not None:
        return limits.kv_cache_bytes
    device = next(module.parameters()).device
    return int(GPU_FREE_MEMORY_FRACTION * cuda_available_bytes(device)) if device.type == "cuda" else CPU_KV_CACHE_BYTES


def plan_slots(module: StageModule, num_requests: int, max_len: int, limits: RolloutLimits) -> int:
    """Number of cache slots: as many as the budget holds, at most ``max_slots`` and the request count."""
    budget = kv_budget_bytes(module, limits)
    slot_bytes = kv_bytes_per_slot(module, max_len)
    if num_requests and budget < slot_bytes:
        raise ConfigError(f"a KV cache slot of {max_len} tokens needs {slot_bytes} bytes, over "
                          f"the budget of {budget}; raise kv_cache_bytes or shorten prompts / max_new_tokens")
    return slot_count(budget, slot_bytes, num_requests, limits.max_slots)


def block_tokens_for(module: StageModule, limits: RolloutLimits) -> int:
    """A paged cache's block: ``limits.block_tokens``, else 256 positions where flash-attn's paged decode kernel
    serves (CUDA, half precision, installed: its blocks must be a multiple of 256), else 16."""
    if limits.block_tokens:
        return limits.block_tokens
    return FLASH_BLOCK_TOKENS if flash_pages(module) else DEFAULT_BLOCK_TOKENS


def flash_pages(module: StageModule) -> bool:
    """Whether flash-attn's paged decode kernel serves this stage (installed, CUDA, half precision). Without it a
    paged cache gathers each row's blocks into one span per layer and step, an extra write and read of the keys and
    values that the contiguous cache does not make: ``generation.kv_cache=auto`` then keeps the contiguous one."""
    device = next(module.parameters()).device
    return (flash_attn_with_kvcache is not None and device.type == "cuda"
            and module.dtype in (torch.float16, torch.bfloat16))


def least_over_stages(module: StageModule, value: int) -> int:
    """The smallest ``value`` over the replica's pipeline stages (one all-reduce under pp): every stage keeps the
    same host state, so its slot and block counts must agree though its layers and free memory differ."""
    ctx = module.ctx
    if ctx.pp_size == 1:
        return value
    flag = torch.tensor([value], dtype=torch.int64, device=next(module.parameters()).device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=ctx.pp_group)
    return int(flag.item())


def new_rollout_cache(module: StageModule, num_requests: int, max_len: int, limits: RolloutLimits,
                      num_groups: int) -> CacheState | None:
    """The engine's cache for ``num_requests`` requests (None when there are none) of at most ``max_len`` tokens.

    Contiguous: ``plan_slots`` slots of ``max_len``. Paged: ``min(max_slots, requests)`` rows over a pool of
    blocks, as many as the budget holds and at most every row's ``max_len`` (more would never be used), split into
    one pool per micro-group of ``num_groups``; each pool must hold one sequence of ``max_len``."""
    if not (limits.paged if limits.paged is not None else flash_pages(module)):
        slots = least_over_stages(module, plan_slots(module, num_requests, max_len, limits))
        return module.new_cache(slots, max_len) if slots else None
    rows = min(limits.max_slots, num_requests)
    if not rows:
        return None
    block_tokens = block_tokens_for(module, limits)
    per_row = blocks_for(max_len, block_tokens)
    budget_blocks = kv_budget_bytes(module, limits) // kv_bytes_per_slot(module, block_tokens)
    pools = [(g.start, g.stop) for g in slot_groups(rows, num_groups) if g.size]
    blocks = least_over_stages(module, min(budget_blocks, rows * per_row))
    if blocks // len(pools) < per_row:
        raise ConfigError(f"a paged KV cache of {blocks} blocks of {block_tokens} tokens cannot hold one sequence of "
                          f"{max_len} tokens in each of {len(pools)} micro-group(s) ({per_row} blocks each); raise "
                          "generation.kv_cache_gib or shorten prompts / max_new_tokens")
    return module.new_paged_cache(rows, max_len, block_tokens, blocks, pools)


def _bucket(n: int, slots: int) -> int:
    return 0 if n == 0 else min(slots, 1 << (n - 1).bit_length())


def _stage_step(module: StageModule, inputs: torch.Tensor, batch: PackedBatch, cache, select) -> torch.Tensor | None:
    """One forward of this stage inside a pipeline run stage after stage; the last stage returns its logits slice."""
    ctx = module.ctx
    if not ctx.is_first_stage:
        buffer = torch.empty(batch.num_tokens, module.cfg.hidden_size, dtype=module.dtype, device=inputs.device)
        inputs = recv_tensor(buffer, ctx.prev_rank)
    out = module(inputs, batch, cache=cache, select=select)
    if not ctx.is_last_stage:
        send_tensor(out, ctx.next_rank)
        return None
    return out


def join_sparse_layers(module: StageModule) -> None:
    """Take part in one step of this stage's sparse layers with no tokens of our own (ep: peers may send us theirs)."""
    empty = torch.empty(0, module.cfg.hidden_size, dtype=module.dtype, device=next(module.parameters()).device)
    for block in module.layers.values():
        if isinstance(block.mlp, MoEMLP):
            block.mlp(empty)


def is_partitioned(module: StageModule) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions this module's parameters (its mark on them: ``ds_status``)."""
    return any(hasattr(p, "ds_status") for p in module.parameters())


def lockstep_group(module: StageModule) -> dist.ProcessGroup | None:
    """The group whose replicas must run the same forwards: the ep group under ep (sparse layers exchange tokens),
    the dp group of a ZeRO-3 partitioned module (every forward gathers its parameters over it); else None."""
    ctx = module.ctx
    if ctx.ep_size > 1:
        return ctx.ep_group
    if ctx.strategy.dp > 1 and is_partitioned(module):
        assert ctx.dp_group is not None, "a partitioned module's context needs its dp group"
        return ctx.dp_group
    return None


def join_forward(module: StageModule) -> None:
    """A forward of one dummy token (position 0, no cache) through this stage, its output dropped: under ZeRO-3 its
    hooks gather the stage's parameters as a real forward's do, so peers' gathers have every rank."""
    device = next(module.parameters()).device
    inputs = (torch.zeros(1, dtype=torch.int64, device=device) if module.ctx.is_first_stage
              else torch.zeros(1, module.cfg.hidden_size, dtype=module.dtype, device=device))
    module(inputs, PackedBatch.from_seqlens([1], device=device))


def join_step(module: StageModule) -> None:
    """One forward's part with no work of our own, in lockstep with the replicas of ``lockstep_group``."""
    if is_partitioned(module):
        join_forward(module)
    else:
        join_sparse_layers(module)


def peers_done(done: bool, group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Whether every replica of ``group`` is done (one small all-reduce); ``done`` when there is no group."""
    if group is None:
        return done
    flag = torch.tensor([1 if done else 0], dtype=torch.int64, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


class RolloutEngine:
    """Runs ``requests`` (prompt index, max new tokens, noise key) over ``num_slots`` cache slots.

    Partial rollouts (``generation.continue_generate``): request r's prompt may end with ``started[r]`` answer
    tokens chosen earlier (by older weights); it is prefilled whole, like any prompt, and decodes on from answer
    position ``started[r]``, so its noise continues where it stopped. With ``must_finish`` = M, ``run`` stops as
    soon as requests ``0 .. M-1`` are all done (at the check that sees the last EOS, or at once when the last
    leaves at its max length), leaving the later ones in their slots (their answers so far in the outputs) or
    waiting; the cache then holds at most M slots, so later requests start only as the first ones free theirs."""

    def __init__(self, module: StageModule, prompts: Sequence[Sequence[int]], prompt_of: Sequence[int],
                 max_new: Sequence[int], keys: torch.Tensor, params: SamplingParams, eos_ids: Sequence[int],
                 limits: RolloutLimits, decode_mode: DecodeMode | None = None, started: Sequence[int] | None = None,
                 must_finish: int | None = None, max_len: int | None = None):
        self.module, self.prompts, self.prompt_of, self.max_new = module, prompts, list(prompt_of), list(max_new)
        self.params, self.limits = params, limits
        self.device = device = next(module.parameters()).device
        requests = len(self.prompt_of)
        self.started = list(started) if started is not None else [0] * requests
        self.must_finish = must_finish if must_finish is not None else requests
        width = max(self.max_new, default=1)
        if max_len is None:  # a slot's length: the longest prompt + answer (TurnEngine gives its episodes')
            max_len = max((len(prompts[p]) + m - s for p, m, s in zip(self.prompt_of, self.max_new, self.started)),
                          default=1)
        ctx, cfg = module.ctx, module.cfg
        self.num_groups = group_count(limits.pp_groups, ctx.pp_size)
        self.cache = new_rollout_cache(module, self.must_finish, max_len, limits, self.num_groups)
        self.num_slots = slots = len(self.cache.lengths) if self.cache is not None else 0
        self.queue = deque(range(requests))
        # Host bookkeeping per slot (exact, never read back from the device).
        self.request = [-1] * slots  # -1: free
        self.length = [0] * slots  # tokens in the cache before this step's input
        self.step = [0] * slots  # answer tokens chosen so far
        self.admitted = [0] * slots  # when the slot's request was admitted (a count): preemption takes the newest
        self.admissions = 0
        self.preempted = 0  # requests preempted (their blocks given back, put back in the queue, recomputed)
        # Device state per slot, and the outputs (one spare row takes the free slots' writes).
        self.next_tokens = torch.zeros(slots, dtype=torch.int64, device=device)
        self.alive = torch.zeros(slots, dtype=torch.bool, device=device)
        self.slot_keys = torch.zeros(slots, dtype=torch.int64, device=device)
        self.keys = keys.to(device)
        vocab = module.cfg.vocab_size  # an id past the vocabulary (some configs list one) is never sampled
        self.eos = torch.tensor([i for i in eos_ids if 0 <= i < vocab], dtype=torch.int64, device=device)
        self.is_eos = torch.zeros(vocab, dtype=torch.bool, device=device)  # a gather, not isin's sort
        self.is_eos[self.eos] = True
        self.tokens = torch.full((requests + 1, width), params.pad_token_id, dtype=torch.int64, device=device)
        self.logprobs = torch.zeros(requests + 1, width, dtype=torch.float32, device=device)
        self.lengths = torch.tensor(self.started + [0], dtype=torch.int64, device=device)
        self.vocab_sizes = vocab_sizes(module.cfg.vocab_size, module.ctx)
        self.whole = SlotGroup(0, slots)
        self.lockstep = lockstep_group(module)  # None: this replica steps on its own
        # decode_mode None: CUDA graphs where they serve (decode_graphs.choose_decode_mode), else eager.
        self.decode_mode, self.decode_reason = (decode_mode, "asked for") if decode_mode else (
            ("eager", "micro-groups in flight (rollout_pipeline.py)") if self.num_groups > 1 else choose_decode_mode(
                device, enabled=params.cuda_graphs, tp_size=ctx.tp_size, pp_size=ctx.pp_size, ep_size=ctx.ep_size,
                sparse=any(cfg.is_sparse(i) for i in range(*module.layer_range)),
                partitioned=is_partitioned(module),
                tp_backend=str(dist.get_backend(ctx.tp_group)) if ctx.tp_size > 1 else "nccl"))
        if self.num_groups > 1 and self.decode_mode == "graphs":
            raise ConfigError("CUDA-graph decode steps all slots at once; use pp_groups=1 with decode_mode='graphs'")
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
                if not lockstep and self.queue and -1 in self.request:
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
            r < 0 or r >= self.must_finish for r in self.request)

    def unfinished(self) -> list[int]:
        """Requests still decoding in a slot (their answers so far in the outputs) or waiting, in request order."""
        return sorted([r for r in self.request if r >= 0] + list(self.queue))

    def bound(self, group: SlotGroup | None = None) -> int:
        """Slots a decode step of ``group`` (default: all) runs over from its first: past its last busy one, to a power of 2."""
        group = group if group is not None else self.whole
        last = max((i for i in range(group.start, group.stop) if self.request[i] >= 0), default=group.start - 1)
        return _bucket(last + 1 - group.start, group.size)

    def busy(self, group: SlotGroup) -> bool:
        return any(self.request[i] >= 0 for i in range(group.start, group.stop))

    def _retire(self, slots: list[int]) -> None:
        for i in slots:
            self.request[i], self.length[i], self.step[i] = -1, 0, 0
            assert self.cache is not None  # slots exist when requests do
            self.cache.release(i)
        if slots:
            self.alive.index_fill_(0, torch.tensor(slots).to(self.device, non_blocking=True), False)

    def reap(self, group: SlotGroup | None = None) -> None:
        """The check: one read of the alive flags; requests that stopped at EOS leave their slots."""
        group = group if group is not None else self.whole
        bound = self.bound(group)
        if bound:
            alive = self.alive[group.start:group.start + bound].tolist()  # the one host sync per check
            self._retire([group.start + i for i in range(bound) if self.request[group.start + i] >= 0 and not alive[i]])
        if not self.queue:
            self._compact(group)

    def _compact(self, group: SlotGroup) -> None:
        """Move the requests left in high slots of ``group`` down into its free low ones when that shrinks its bound.

        Nothing waits, so no admission will fill the holes; one copy of a request's cache rows is
        cheaper than decoding the empty slots below it for the rest of its answer.
        """
        busy = [i for i in range(group.start, group.stop) if self.request[i] >= 0]
        if _bucket(len(busy), group.size) >= self.bound(group):
            return
        assert self.cache is not None  # slots exist when requests do
        edge = group.start + len(busy)
        high = [i for i in busy if i >= edge]
        low = [i for i in range(group.start, edge) if self.request[i] < 0]
        for source, target in zip(high, low):
            self.cache.move(source, target, self.length[source])
            self.request[target], self.length[target], self.step[target] = (self.request[source], self.length[source],
                                                                           self.step[source])
            self.admitted[target] = self.admitted[source]
            self.request[source], self.length[source], self.step[source] = -1, 0, 0
        sources, targets = (torch.tensor(x).to(self.device, non_blocking=True) for x in (high, low))
        for state in (self.next_tokens, self.alive, self.slot_keys):
            state.index_copy_(0, targets, state.index_select(0, sources))
        self.alive.index_fill_(0, sources, False)

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
        holder = {self.prompt_of[r]: i for i, r in enumerate(self.request) if r >= 0}
        fresh: dict[int, int] = {}  # prompt -> the slot it is prefilled into now
        copies: dict[tuple[int, int], list[int]] = {}  # (source slot, tokens) -> target slots
        free: list[int] = []  # the slots taken now
        for slot in (i for i in range(group.start, group.stop) if self.request[i] < 0):
            if not self.queue:
                break
            request = self.queue[0]
            prompt = self.prompt_of[request]
            prefix = len(self.prompts[prompt]) - 1
            source = fresh.get(prompt, holder.get(prompt)) if prefix else None
            # Room for the prompt and the first answer token's keys (a sibling shares its prompt's full blocks);
            # without it the queue waits, first come first served, until a request leaves.
            assert self.cache is not None
            if not self.cache.hold(slot, prefix + 1, source, prefix):
                break
            self.queue.popleft()
            free.append(slot)
            self.admissions += 1
            self.admitted[slot] = self.admissions
            self.request[slot], self.length[slot], self.step[slot] = request, prefix, self.started[request]
            if prefix == 0:
                continue
            if prompt in fresh or prompt in holder:
                copies.setdefault((fresh.get(prompt, holder.get(prompt, -1)), prefix), []).append(slot)
            else:
                fresh[prompt] = slot
            holder.setdefault(prompt, slot)
        if free:
            index = torch.tensor(free).to(self.device, non_blocking=True)
            requests = [self.request[i] for i in free]
            last = torch.tensor([self.prompts[self.prompt_of[r]][-1] for r in requests])
            self.next_tokens.index_copy_(0, index, last.to(self.device, non_blocking=True))
            self.alive.index_fill_(0, index, True)
            self.slot_keys.index_copy_(0, index, self.keys.index_select(
                0, torch.tensor(requests).to(self.device, non_blocking=True)))
        return Admission(list(fresh.values()), [self.prompts[p][:-1] for p in fresh], copies)

    def copy_prefixes(self, admission: Admission) -> None:
        """After the prefill of ``admission``: the siblings' slots copy their prompt's keys/values."""
        for (source, tokens), targets in admission.copies.items():  # one copy per cache tensor for all of a prompt's siblings
            assert self.cache is not None  # slots exist when requests do
            self.cache.copy_prefix(source, targets, tokens)

    def prefill_forward(self, slots: list[int], inputs: torch.Tensor, batch: PackedBatch,
                        forward: Callable[..., torch.Tensor | None] = _stage_step) -> torch.Tensor | None:
        """Prefill ``batch`` into cache rows ``slots`` with ``forward`` (``_stage_step``, or a stage alone under a
        pipelined rollout: ``(module, inputs, batch, cache, select)``); returns what it returns."""
        assert self.cache is not None  # slots exist when requests do
        self.cache.flush()
        self.cache.rows = torch.tensor(slots).to(self.device, non_blocking=True)
        self.cache.decoding = False
        out = forward(self.module, inputs, batch, self.cache, torch.empty(0, dtype=torch.int64, device=self.device))
        self.cache.rows = None
        return out

    def _prefill(self, slots: list[int], prefixes: list[Sequence[int]]) -> None:
        self.prefill_forward(slots, *pack(prefixes, device=self.device))

    def _host_rows(self, group: SlotGroup, bound: int) -> torch.Tensor:
        """Point the cache at ``group``'s first ``bound`` slots for a decode step; their ``stage_inputs`` rows."""
        assert self.cache is not None  # slots exist when requests do
        lo, hi = group.start, group.start + bound
        self._grow(lo, hi)
        # A graph replays one shape per bucket: attention then covers every cache position, masked.
        self.cache.longest = self.cache.max_len - 1 if self.graphs.fixed_span else max(self.length[lo:hi])
        self.cache.first_row = lo
        return stage_inputs(self.length[lo:hi], self.step[lo:hi], self.request[lo:hi], bound, len(self.tokens) - 1)

    def _grow(self, lo: int, hi: int) -> None:
        """Give slots ``lo .. hi - 1`` room for this step's keys; where a pool runs out, preempt its newest request
        (vLLM's rule: the oldest always progress) until there is room or the slot itself was the newest."""
        assert self.cache is not None  # slots exist when requests do
        for i in range(lo, hi):
            while self.request[i] >= 0 and not self.cache.hold(i, self.length[i] + 1):
                pool = self.cache_pool(i)
                self._preempt(max((j for j in pool if self.request[j] >= 0), key=lambda j: self.admitted[j]))
        self.cache.flush()

    def cache_pool(self, slot: int) -> range:
        """The slots whose cache rows share ``slot``'s block pool (the whole engine, or its pipelined micro-group)."""
        if self.num_groups == 1:
            return range(self.num_slots)
        return next(range(g.start, g.stop) for g in slot_groups(self.num_slots, self.num_groups)
                    if g.start <= slot < g.stop)

    def _preempt(self, slot: int) -> None:
        """Put ``slot``'s request back at the head of the queue, its blocks given back and its answer so far
        dropped: it is recomputed from its prompt when it gets a slot again (its noise is keyed by request and
        step, so it draws the same tokens)."""
        request, started = self.request[slot], self.started[self.request[slot]]
        assert self.cache is not None  # slots exist when requests do
        self.cache.release(slot)
        self.request[slot], self.length[slot], self.step[slot] = -1, 0, 0
        self.alive[slot] = False
        self.tokens[request, started:] = self.params.pad_token_id
        self.logprobs[request, started:] = 0.0
        self.lengths[request] = started
        self.queue.appendleft(request)  # it was admitted before everything waiting
        self.preempted += 1

    def stage_group(self, group: SlotGroup, bound: int) -> torch.Tensor:
        """Set up a decode step of ``group``'s first ``bound`` slots (eager); returns their staged rows."""
        staged = self.graphs.staged[:, group.start:group.start + bound]
        staged.copy_(self._host_rows(group, bound), non_blocking=True)
        return staged

    def advance(self, group: SlotGroup, bound: int) -> None:
        """Host side of a decode step over ``group``'s first ``bound`` slots: one token longer; retire at max length."""
        done = []
        for i in range(group.start, group.start + bound):
            if self.request[i] >= 0:
                self.length[i] += 1
                self.step[i] += 1
                if self.step[i] == self.max_new[self.request[i]]:
                    done.append(i)
        self._retire(done)

    def _decode(self) -> None:
        """One token for every slot below the bound (free slots compute into their own unused rows)."""
        bound = self.bound()
        self.graphs.run(bound, self._host_rows(self.whole, bound), self._decode_step)
        self.advance(self.whole, bound)

    def _decode_step(self, bound: int, staged: torch.Tensor) -> None:
        """The device half of a decode step; it reads and writes only static buffers (a CUDA graph replays it)."""
        assert self.cache is not None  # slots exist when requests do
        positions, steps, _ = staged.unbind(0)  # views of the staging buffer: position, answer step, output row
        self.cache.lengths, self.cache.decoding = positions, True
        logits = _stage_step(self.module, self.next_tokens[:bound], PackedBatch.decode_step(positions), self.cache, None)
        tokens, logprobs = self.choose(logits, 0, staged)
        self._share(tokens, logprobs)
        self.record(0, staged, tokens, logprobs)

    def choose(self, logits: torch.Tensor | None, start: int, staged: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The last stage's tokens and log-probs for slots ``start ..`` (zeros elsewhere, to be overwritten)."""
        params, ctx = self.params, self.module.ctx
        bound, steps = staged.shape[1], staged[1]
        tokens = torch.zeros(bound, dtype=torch.int64, device=self.device)
        logprobs = torch.zeros(bound, dtype=torch.float32, device=self.device)
        if ctx.is_last_stage:
            assert logits is not None  # the last stage's forward returns its logits
            full = gather_from_tp(logits.float(), ctx, self.vocab_sizes)
            held_back = self.eos if params.min_new_tokens else self.eos[:0]  # EOS ids banned before min_new_tokens
            tokens, logprobs = choose_tokens(full, greedy=params.greedy, temperature=params.temperature,
                                             top_k=params.top_k, top_p=params.top_p, min_p=params.min_p,
                                             eos=held_back,
                                             allow_eos=steps >= params.min_new_tokens,
                                             keys=self.slot_keys[start:start + bound], steps=steps)
        return tokens, logprobs

    def record(self, start: int, staged: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Write a decode step's chosen tokens of slots ``start ..`` into the outputs and the slots' state."""
        _, steps, rows = staged.unbind(0)
        bound = staged.shape[1]
        pad = self.params.pad_token_id
        alive = self.alive[start:start + bound]
        self.tokens[rows, steps] = torch.where(alive, tokens, pad)
        self.logprobs[rows, steps] = torch.where(alive, logprobs, 0.0)
        self.lengths.index_add_(0, rows, alive.long())
        alive &= ~self.is_eos[tokens]
        self.next_tokens[start:start + bound] = tokens

    def share_over_tp(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """On the last stage, make every TP rank hold the sampler's choice (greedy: they already agree)."""
        ctx = self.module.ctx
        if ctx.is_last_stage and ctx.tp_size > 1 and not self.params.greedy:  # one sampler decides for the TP group
            for t in (tokens, logprobs):
                dist.broadcast(t, src=ctx.tp_ranks[0], group=ctx.tp_group)

    def _share(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Make every rank of the replica hold the last stage's choice (in place)."""
        ctx = self.module.ctx
        self.share_over_tp(tokens, logprobs)
        if ctx.pp_size > 1:
            for t in (tokens, logprobs):
                dist.broadcast(t, src=ctx.last_stage_rank, group=ctx.pp_group)


def group_count(pp_groups: int | None, pp_size: int) -> int:
    """Micro-groups of slots in flight through ``pp_size`` stages (``RolloutLimits.pp_groups``; the estimator uses it too)."""
    if pp_groups is None:
        return pp_size
    if pp_groups != 1 and pp_groups < pp_size:
        raise ConfigError(f"pp_groups={pp_groups} under pp={pp_size}: use 1 (stages one after another) or at least "
                          f"{pp_size} (a group for every stage), or leave it unset")
    return pp_groups
