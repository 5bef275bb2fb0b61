"""Running one MFC on this rank: generate, inference or train_step over this rank's model shard.

Every rank of one data-parallel replica calls these with the same batch (its DP slice). The
last pipeline stage computes the outputs; they are broadcast over the pipeline group so every
rank of the replica holds the MFC's output batch (what data transfer reads from).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from restage.algorithms import estimators, packed_ops
from restage.algorithms.base import AlgoState, CallContext, answer_mask
from restage.algorithms.interface import Algorithm
from restage.algorithms.registry import LOSS_NORM, LossNorm
from restage.config.schema import ExperimentConfig
from restage.data.batch import Batch, pack_sequences
from restage.device import rank_device
from restage.graph import MFC
from restage.models.decoder import StageModule
from restage.models.moe import RouterLog, router_stats
from restage.models.packing import PackedBatch
from restage.models.parallel import vocab_parallel_entropy, vocab_parallel_logprobs
from restage.models.pipeline import MicroBatch, pipeline_forward, train_1f1b
from restage.rollout.generation import generate
from restage.rollout.lockstep import lockstep_group
from restage.rollout.sampling import SamplingParams, request_seed
from restage.runtime.control.records import merge_rule
from restage.runtime.store.zero_engines import Engine


@dataclass
class MFCResult:
    """What one MFC produced on this rank."""

    batch: Batch | None
    stats: dict[str, float]
    tokens: int


def fewest_samples(batch: Batch, group: dist.ProcessGroup) -> int:
    """The fewest samples any rank of ``group`` holds (one small all-reduce)."""
    fewest = torch.tensor([batch.n_samples], dtype=torch.int64, device=rank_device())
    dist.all_reduce(fewest, op=dist.ReduceOp.MIN, group=group)
    return int(fewest.item())


def _micro_batches(batch: Batch, ids_key: str, n_micro: int, extra: Callable[[Batch], object] = lambda b: b,
                   module: StageModule | None = None, agree_over: dist.ProcessGroup | None = None) -> list[MicroBatch]:
    if agree_over is None and module is not None:
        agree_over = lockstep_group(module)
    if agree_over is not None:
        # Under ep the replicas of an ep group exchange tokens in every sparse layer, a ZeRO-3 module's dp ranks (and a
        # sharded frozen model's) gather its parameters in every forward, and training's dp ranks reduce gradients
        # every micro-batch under ZeRO-2/3: so they must run the same number of micro-batches. The fewest samples any
        # of them holds bounds it (each holds at least one).
        n_micro = min(n_micro, fewest_samples(batch, agree_over))
    parts = batch.split(n_micro, balance="tokens") if batch.n_samples > 1 else [batch]
    device = rank_device()
    return [MicroBatch(part[ids_key].to(device), PackedBatch.from_seqlens(part.seqlens, device=device), extra(part))
            for part in parts]




def forward_results(module: StageModule, logits_or_values: torch.Tensor, mb: MicroBatch, wanted: tuple[str, ...],
                    temperature: float) -> dict[str, torch.Tensor]:
    """Turn the last stage's raw output into aligned per-token ``logprobs`` / ``entropy`` / ``values``.

    ``logprobs[t] = log p(token t | < t)``: the logits at ``t - 1`` scored against token ``t``,
    shifted right per sequence (0 on each sequence's first token).
    """
    out: dict[str, torch.Tensor] = {}
    cu = mb.batch.cu_seqlens
    if "values" in wanted:
        out["values"] = logits_or_values.float()
    if "logprobs" in wanted or "entropy" in wanted:
        targets = torch.roll(mb.tokens, -1)  # next token; wraps at sequence ends, masked by the shift
        if "logprobs" in wanted:
            lp = vocab_parallel_logprobs(logits_or_values, targets, module.ctx, module.vocab_start, temperature)
            out["logprobs"] = packed_ops.shift_right(lp, cu)
        if "entropy" in wanted:
            out["entropy"] = packed_ops.shift_right(vocab_parallel_entropy(logits_or_values, module.ctx, temperature), cu)
    return out


def _share_over_pipeline(module: StageModule, out: dict[str, torch.Tensor] | None, n_tokens: int,
                         keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Broadcast the last stage's per-token outputs to every stage of this replica."""
    ctx = module.ctx
    if ctx.pp_size == 1:
        assert out is not None
        return out
    shared: dict[str, torch.Tensor] = {}
    for key in keys:
        tensor = out[key].contiguous() if out is not None else torch.empty(n_tokens, dtype=torch.float32, device=rank_device())
        dist.broadcast(tensor, src=ctx.last_stage_rank, group=ctx.pp_group)
        shared[key] = tensor
    return shared


@torch.no_grad()
def run_inference(module: StageModule, mfc: MFC, batch: Batch, algo: Algorithm, cfg: ExperimentConfig, state: AlgoState,
                  agree_over: dist.ProcessGroup | None = None) -> MFCResult:
    """``agree_over``: a group whose ranks must run as many micro-batches as each other (a sharded frozen
    model's dp group, whose forwards all-gather its parameters unit by unit: ``runtime/store/sharded_frozen.py``)."""
    wanted = tuple(algo.forward_outputs(mfc.name, cfg))
    ids_key = mfc.inputs[0]
    micro = _micro_batches(batch, ids_key, mfc.micro_batches, module=module, agree_over=agree_over)
    temperature = _policy_temperature(cfg)
    results = pipeline_forward(module, micro, post_fn=lambda o, mb: forward_results(module, o, mb, wanted, temperature))
    merged = None
    if results is not None:
        merged = {k: torch.cat([r[k] for r in results]) for k in wanted}
    outputs = _share_over_pipeline(module, merged, batch.n_tokens, wanted)
    keys = algo.inference(mfc.name, batch, {k: v.cpu() for k, v in outputs.items()}, cfg, state)
    per_token = {k: v for k, v in keys.items() if v.shape[0] == batch.n_tokens and batch.n_tokens != batch.n_seqs}
    per_seq = {k: v for k, v in keys.items() if k not in per_token}
    out = Batch(batch.seqlens, per_token, per_seq, batch.group_size, batch.ids)
    return MFCResult(out, {}, batch.n_tokens)


def _policy_temperature(cfg: ExperimentConfig) -> float:
    gen = cfg.generation
    return 1.0 if gen.greedy else gen.temperature


@torch.no_grad()
def run_generate(module: StageModule, mfc: MFC, prompts: Batch, algo: Algorithm, cfg: ExperimentConfig, state: AlgoState,
                 call: CallContext, seed: int, version: int | None = None) -> MFCResult:
    """Sample ``group_size`` answers per prompt; the output batch holds seqs, prompt_mask and logprobs (and, when the
    MFC outputs ``versions``, async mode's per-token policy ``version`` of the weights in ``module``)."""
    group = mfc.options.group
    prompt_ids = prompt_lists(prompts)
    params = sampling_params(module, mfc, cfg, seed)
    # each prompt prefilled once for its group
    result = generate(module, prompt_ids, params, group_size=group, seeds=request_seeds(prompts, group, seed))
    answers = result.sequences()
    versions = None if version is None else [[version] * len(a) for a in answers]
    return answers_result(mfc, prompts, answers, result.token_logprobs(), versions, algo, cfg, state, call)


def step_seed(seed: int, step: int) -> int:
    """The seed of a step's generation: every rank of every layout draws the same one."""
    return (seed * 1_000_003 + step) * 101


def request_seeds(prompts: Batch, group: int, seed: int) -> list[int]:
    """Each request's noise seed (request ``i * group + j`` is answer j to prompt i): a function of ``seed`` and the
    sample's dataset id, not of its place in this rank's share, so a sample gets the same answer whichever dp rank of
    whichever layout generates it (a batch without ids numbers its prompts instead)."""
    keys = [int(i) for i in prompts.ids] if prompts.ids else list(range(prompts.n_samples))
    return [request_seed(seed, key * group + j) for key in keys for j in range(group)]


def prompt_lists(prompts: Batch) -> list[list[int]]:
    """A generate MFC's prompts as token lists."""
    return [t.tolist() for t in torch.split(prompts["prompts"], list(prompts.seqlens))]


def sampling_params(module: StageModule, mfc: MFC, cfg: ExperimentConfig, seed: int) -> SamplingParams:
    """The sampling of a generate MFC's batch seeded ``seed`` (request r's noise: ``request_seed(seed, r)``)."""
    gen = cfg.generation
    eos = module.cfg.eos_token_id
    pad = module.cfg.pad_token_id if module.cfg.pad_token_id is not None else (eos or 0)
    return SamplingParams(**{**dataclasses.asdict(gen), "greedy": gen.greedy or mfc.greedy}, pad_token_id=pad, seed=seed)


def answers_result(mfc: MFC, prompts: Batch, answers: list[list[int]], answer_logprobs: list[list[float]],
                   versions: list[list[int]] | None, algo: Algorithm, cfg: ExperimentConfig,
                   state: AlgoState, call: CallContext) -> MFCResult:
    """A generate MFC's output batch from its answers (request ``i * group_size + j``: sample j of prompt i), their
    log-probs and (async mode) each answer token's policy version."""
    group = mfc.options.group
    repeated = [p for p in prompt_lists(prompts) for _ in range(group)]
    # An empty answer (EOS first with min_new_tokens=0 still yields that EOS) keeps at least one token.
    seqs = [p + a for p, a in zip(repeated, answers, strict=True)]
    batch = pack_sequences(seqs, group_size=group, key=mfc.outputs[0], prompt_lens=[len(p) for p in repeated],
                           ids=prompts.ids)
    mask_key = mfc.outputs[1]
    if mask_key != "prompt_mask":
        batch = batch.renamed({"prompt_mask": mask_key})
    lp = torch.cat([torch.cat([torch.zeros(len(p)), torch.tensor(a, dtype=torch.float32)])
                    for p, a in zip(repeated, answer_logprobs, strict=True)])
    if "logprobs" in mfc.outputs:
        batch = batch.with_keys(tokens={"logprobs": lp})
    if "versions" in mfc.outputs:
        if versions is None:
            raise ValueError(f"{mfc.name} outputs versions but the runtime gave no policy version")
        flat = [x for p, v in zip(repeated, versions, strict=True) for x in [-1] * len(p) + v]  # -1 on prompt tokens
        batch = batch.with_keys(tokens={"versions": torch.tensor(flat, dtype=torch.int64)})
    batch = algo.after_generate(mfc.name, batch, cfg, state, call)
    generated = sum(len(a) for a in answers)
    stats = {f"{mfc.name}/answer_tokens": generated / max(1, len(seqs))}
    return MFCResult(batch, stats, batch.n_tokens)


@torch.no_grad()
def run_eval_generate(module: StageModule, mfc: MFC, prompts: Batch, cfg: ExperimentConfig) -> Batch:
    """One greedy answer per prompt (evaluation during training, runtime/step/evaluation.py): the MFC's ids and mask keys.

    Greedy decoding takes no random numbers, so the run's RNG streams are as without evaluation.
    """
    gen = cfg.generation
    prompt_ids = [t.tolist() for t in torch.split(prompts["prompts"], list(prompts.seqlens))]
    eos = module.cfg.eos_token_id
    pad = module.cfg.pad_token_id if module.cfg.pad_token_id is not None else (eos or 0)
    params = SamplingParams(max_new_tokens=gen.max_new_tokens, min_new_tokens=gen.min_new_tokens, greedy=True,
                            pad_token_id=pad, cuda_graphs=gen.cuda_graphs, kv_cache_gib=gen.kv_cache_gib,
                            max_slots=gen.max_slots, kv_cache=gen.kv_cache, kv_block_tokens=gen.kv_block_tokens)
    answers = generate(module, prompt_ids, params).sequences()
    batch = pack_sequences([p + a for p, a in zip(prompt_ids, answers, strict=True)], key=mfc.outputs[0],
                           prompt_lens=[len(p) for p in prompt_ids], ids=prompts.ids)
    return batch.renamed({"prompt_mask": mfc.outputs[1]}) if mfc.outputs[1] != "prompt_mask" else batch


def loss_scale_factor(engine: Engine, device: torch.device | None = None) -> float:
    """What ``engine.backward`` multiplies a scalar loss by before autograd: fp16's loss scale, else 1."""
    # lazy: DeepSpeed takes seconds to import
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    # A scalar with a grad_fn, which is what DeepSpeed's scaling recognises as a loss.
    probe = torch.ones((), device=device, requires_grad=True) * 1.0
    if isinstance(engine.optimizer, ZeROOptimizer):
        return float(engine.optimizer.scale_if_loss(probe).detach())
    scaler = getattr(engine, "torch_autocast_z0_gradscaler", None)
    return float(scaler.scale(probe).detach()) if scaler is not None else 1.0


def stage_backward(engine: Engine, tensor: torch.Tensor, grad: torch.Tensor | None,
                   stage_loss: torch.Tensor | None = None) -> None:
    """One micro-batch's backward on one pipeline stage, through the engine.

    DeepSpeed owns loss scaling, gradient accumulation and the ZeRO reductions, so every stage's
    backward goes through ``engine.backward``. The last stage passes its loss (``grad`` None).
    Off the last stage the surrogate ``sum(out * grad)`` has exactly the parameter gradients of
    ``backward(out, grad)``; ``grad`` already carries the last stage's loss scale and 1/GAS, so
    the surrogate is divided by the scale the engine multiplies every loss by (fp16) and
    ``scale_wrt_gas`` is off. It is summed in fp32: an fp16 sum of scaled products overflows.
    ``stage_loss`` (a mixture's load-balancing loss of this stage's layers, in the units of the
    last stage's loss) is added to the surrogate divided by the accumulation steps, as the last
    stage's loss is.
    """
    if grad is None:
        engine.backward(tensor)
    else:
        surrogate = (tensor.float() * grad.float()).sum() / loss_scale_factor(engine, tensor.device)
        if stage_loss is not None:
            surrogate = surrogate + stage_loss.float() / engine.gradient_accumulation_steps()
        engine.backward(surrogate, scale_wrt_gas=False)
    _end_micro_step(engine)


def _end_micro_step(engine: Engine) -> None:
    """Tell a ZeRO optimizer that a micro-batch's backward is done.

    DeepSpeed does it in ``engine.forward`` (``optimizer.clear_backward_seen_flag()``), which the pipeline never
    calls: it runs ``engine.module`` itself. ZeRO-3 counts micro-steps there (``micro_step_id``) and copies, rather
    than adds, a micro-batch's gradient partitions while the count is 0: without this only the last micro-batch
    of each optimizer step kept its gradient (a dp2 ZeRO-3 run with 2 micro-batches ended 2% from one rank).
    """
    # lazy: DeepSpeed takes seconds to import; only where an engine trains
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    if isinstance(engine.optimizer, ZeROOptimizer):
        engine.optimizer.clear_backward_seen_flag()


def run_train(engine: Engine, mfc: MFC, batch: Batch, algo: Algorithm, cfg: ExperimentConfig, state: AlgoState,
              call: CallContext, seed: int, router_aux_loss_coef: float | None = None) -> MFCResult:
    """``epochs`` passes over the batch in ``minibatches`` optimizer steps, each over ``micro_batches``;
    ``router_aux_loss_coef``: a mixture of experts' load-balancing loss weight (the schedule's ``ModelEntry``)."""
    module: StageModule = engine.module
    module.train()
    wanted = tuple(algo.forward_outputs(mfc.name, cfg))
    temperature = _policy_temperature(cfg)
    ids_key = mfc.inputs[0]
    stats_sum: dict[str, float] = {}
    extremes: dict[str, float] = {}  # the *_max and *_min statistics (records.merge_rule)
    count = 0

    params = getattr(state, "params", None)
    step_norm: list[LossNorm | None] = [None]  # the current optimizer step's (loss_norm), for aggregated losses

    def loss_fn(output: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        outputs: dict[str, Any] = dict(forward_results(module, output, mb, wanted, temperature))
        if step_norm[0] is not None:
            outputs[LOSS_NORM] = step_norm[0]
        loss, stats = algo.loss(mfc.name, mb.extra.to(output.device), outputs, cfg, state, call)
        return loss, stats

    can_stop = getattr(params, "early_stop_ratio", 0.0) > 0 or getattr(params, "early_stop_kl", 0.0) > 0
    done = [0]  # backward passes in the current minibatch
    n_micro = [1]

    def backward_fn(tensor: torch.Tensor, grad: torch.Tensor | None, stage_loss: torch.Tensor | None = None, /) -> None:
        # The boundary is set by hand and the optimizer steps once after the whole 1F1B schedule:
        # stepping inside it would put the gradient-norm collective (over all stages) between two
        # stages' pipeline sends.
        engine.set_gradient_accumulation_boundary(done[0] == n_micro[0] - 1)
        stage_backward(engine, tensor, grad, stage_loss)
        done[0] += 1

    routing = RouterLog(module.cfg, router_aux_loss_coef) if module.cfg.is_moe else None

    # The dp ranks step the optimizer together and reduce gradients (every micro-batch under ZeRO-2/3, and ZeRO-3
    # gathers parameters every forward): as many minibatches and micro-batches on each, whatever samples it holds.
    dp_group = module.ctx.dp_group if module.ctx.strategy.dp > 1 else None
    minibatches = mfc.minibatches if dp_group is None else min(mfc.minibatches, fewest_samples(batch, dp_group))
    for _, _, minibatch in estimators.minibatches(batch, minibatches, mfc.epochs, seed):
        micro = _micro_batches(minibatch, ids_key, mfc.micro_batches, module=module, agree_over=dp_group)
        if len(micro) != engine.gradient_accumulation_steps():
            # Fewer samples than micro-batches on this minibatch: accumulate over what there is.
            engine.set_train_batch_size(len(micro) * engine.train_micro_batch_size_per_gpu() * engine.dp_world_size)
        done[0], n_micro[0] = 0, len(micro)
        if hasattr(params, "loss_agg"):  # a policy loss aggregated by algo.loss_agg (ppo, grpo, remax)
            step_norm[0] = loss_norm(micro, dp_group)
        results = train_1f1b(module, micro, loss_fn, backward_fn, sync_tied=False, routing=routing)
        stop = can_stop and _early_stop_anywhere(engine, results)
        if stop:
            _step_without_update(engine)
        else:
            engine.step()
        for _, stats in results or []:
            for k, v in stats.items():
                rule = merge_rule(k)
                if rule == "mean":
                    stats_sum[k] = stats_sum.get(k, 0.0) + float(v)
                else:
                    extremes[k] = (max if rule == "max" else min)(extremes.get(k, float(v)), float(v))
            count += 1
        if stop:
            break  # the rest of this batch's minibatches and epochs
    module.eval()
    stats = {f"{mfc.name}/{k}": v / count for k, v in stats_sum.items()} if count else {}
    stats.update({f"{mfc.name}/{k}": v for k, v in extremes.items()})
    stats[f"{mfc.name}/lr"] = float(engine.get_lr()[0])
    if routing is not None:
        stats.update({f"{mfc.name}/{k}": v for k, v in router_stats(routing, module.ctx, rank_device()).items()})
    return MFCResult(None, stats, batch.n_tokens * mfc.epochs)


def loss_norm(micro: list[MicroBatch], dp_group: dist.ProcessGroup | None) -> LossNorm:
    """The optimizer step's answer tokens, sequences and sequences with answer tokens, over every micro-batch of
    this rank and (a sum over ``dp_group``) of its dp peers, per loss part (``registry.LossNorm``). Every rank of the
    dp group calls it at the same point of the step (the all-reduce is a collective)."""
    counts = torch.zeros(3, dtype=torch.float64)
    for mb in micro:
        batch: Batch = mb.extra
        mask = answer_mask(batch)
        per_seq = packed_ops.seq_sum(mask.double(), batch.cu_seqlens)
        counts += torch.tensor([float(mask.sum()), batch.n_seqs, float((per_seq > 0).sum())], dtype=torch.float64)
    parts = len(micro)
    if dp_group is not None:
        counts = counts.to(rank_device())
        dist.all_reduce(counts, group=dp_group)
        parts *= dist.get_world_size(dp_group)
    tokens, seqs, answered = (float(c) / parts for c in counts.cpu())
    return LossNorm(tokens, seqs, answered)


def _early_stop_anywhere(engine: Engine, results: list[tuple[Any, dict[str, float]]] | None) -> bool:
    """Whether any micro-batch on any rank of the train layout tripped the algorithm's early stop.

    Only last pipeline stages see the loss statistics: a MAX over the replica's model-parallel
    ranks, then over its DP group, gives every rank the same answer (they all step or none does).
    """
    flag = max((float(stats.get("early_stop", 0.0)) for _, stats in results or []), default=0.0)
    tensor = torch.tensor([flag], device=rank_device())
    mpu = engine.mpu
    if mpu.get_model_parallel_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=mpu.get_model_parallel_group())
    if mpu.get_data_parallel_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=mpu.get_data_parallel_group())
    return bool(tensor.item() > 0)


def _step_without_update(engine: Engine) -> None:
    """Close the minibatch without moving the parameters: an optimizer step at learning rate 0.

    Stepping (rather than dropping the ZeRO-reduced gradients by hand) keeps DeepSpeed's
    accumulation state consistent; AdamW's update and weight decay both scale with the learning
    rate, so nothing moves (its moment estimates do see this minibatch's gradients).
    """
    groups = engine.optimizer.param_groups
    saved = [group["lr"] for group in groups]
    for group in groups:
        group["lr"] = 0.0
    engine.step()
    for group, lr in zip(groups, saved, strict=True):
        if group["lr"] == 0.0:  # no scheduler stepped it back
            group["lr"] = lr
