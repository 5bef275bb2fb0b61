"""Published measurements of RLHF stages and LLM training on A100/A800/H100, with the workload each ran.

Every entry names its source and the exact work: model, GPUs, batch, prompt and answer lengths, and
the system's plan and engine. ``bench/calibration.py`` predicts each with restage's cost model and
prints the error. Stages a system runs as restage's runtime does (DeepSpeed ZeRO-3 training, eager
PyTorch) are predicted with restage's own model; generation the system runs with vLLM is predicted
with ``plan/generation_cost.py``'s vLLM model.

OpenRLHF benchmark (OPENRLHF): the README of the branch ``wuxibin/benchmark`` of OpenRLHF (last commit
dbdd43b0, 2024-03-26; the table was later on main as benchmark/README.md without its last two rows), with
the scripts of that branch. A800-SXM-80GB (A100 compute and HBM, NVLink 400 GB/s in total), one PPO
pass over a rollout of 1,024 prompts (``prompt_max_len`` 1,024, ``generate_max_len`` 1,024),
train_batch_size 128 (8 optimizer steps per model), actor, critic, reference and reward all LLaMA-2 of
one size (CodeLlama-34B at 34B), gradient checkpointing. GPU counts follow from the published TFLOP/s,
which OpenRLHF's ``openrlhf/utils/perf.py`` (commit 1072da90) computes with the nominal 2,048 tokens per
sample over every GPU of the run: 8 GPUs for every 7B, 13B and 34B row (1:1:2:2:2 =
ref:reward:actor:critic:vLLM GPUs) and 16 for 70B (2:2:4:4:4). "Generation" is OpenRLHF's make-experience
phase: vLLM generation of each micro-rollout batch, then the actor's, reference's, reward's and critic's
forward passes over it.

How each system ran, from the branch's scripts:

* OpenRLHF rows (``examples/scripts/train_ppo_llama.sh``, ``train_ppo_llama_ray.sh``,
  ``train_ppo_llama_ray_34b.sh``, ``train_ppo_llama_ray_70b.sh`` at dbdd43b0): ``--zero_stage 2`` at 7B
  and 13B and ``--zero_stage 3`` at 70B (34B: ZeRO-3 too, ``_train`` says why), ``--adam_offload``
  (AdamW on the host) everywhere, ``--flash_attn``; the 70B script runs ``--vllm_num_engines 2
  --vllm_tensor_parallel_size 2``. Micro-batches are the table's. vLLM 0.3.1 is called with no
  ``ignore_eos`` (``experience_maker._generate_vllm``): answers end at EOS, and prompts are sent
  without their padding; the lengths they had are not published, so the work is costed at the
  nominal 1,024 + 1,024 tokens, an upper bound.
* DeepSpeed-Chat rows (``benchmark/deepspeed-chat/llama_7b.sh`` and ``llama_13b.sh`` at dbdd43b0, run
  with DeepSpeedExamples' step-3 ``main.py``): actor ZeRO-2 and critic ZeRO-3
  (``ACTOR_ZERO_STAGE=2``, ``CRITIC_ZERO_STAGE=3``), ``--offload``, which DeepSpeed-Chat's
  ``dschat/utils/ds_utils.get_train_ds_config`` turns into ``offload_optimizer`` and ``offload_param``
  on the host (the latter only acts under ZeRO-3: the critic), gradient checkpointing for both, the
  hybrid engine off; per device 8 (7B) / 2 (13B) sequences a micro-batch with 2 / 8 accumulation steps.
  Each micro-batch trains the actor then the critic on all 8 GPUs. DeepSpeed-Chat pads every prompt to
  ``max_prompt_seq_len`` and generates greedily to ``max_length``, stopping only when every answer of the
  batch has ended, so its sequences are the nominal 2,048 tokens. The "w/o offload" row (dbdd43b0) is
  the same run without ``--offload``, at 4 sequences a micro-batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

OPENRLHF = ("https://github.com/OpenRLHF/OpenRLHF/blob/wuxibin/benchmark/benchmark/README.md (commit dbdd43b0; "
            "A800, vLLM 0.3.1, DeepSpeed 0.13.2)")
TORCHTITAN = ("https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md "
              "(H100 96GB HBM2e 2.4 TB/s, 500 W)")


@dataclass(frozen=True)
class Placed:
    """One model of a stage on ``gpus`` devices (ZeRO data parallel), with its micro-batch per device, its ZeRO
    stage and what it keeps on the host."""

    arch: str
    gpus: int
    micro_batch: int
    critic: bool = False
    zero_stage: int = 3
    offload_optimizer: bool = False
    offload_params: bool = False


@dataclass(frozen=True)
class TrainStage:
    """Training ``models`` over ``samples`` sequences in steps of ``train_batch``; ``concurrent``: the models train
    at once on disjoint GPUs (the stage takes the longest), else one after the other on the same GPUs."""

    models: tuple[Placed, ...]
    samples: int
    train_batch: int
    seq_tokens: int
    concurrent: bool
    gradient_checkpointing: bool = True


@dataclass(frozen=True)
class VllmStage:
    """OpenRLHF's make-experience with vLLM: ``engines`` engines of ``tp`` GPUs generate, ``live`` prompts in flight
    per engine (actor ranks x micro-rollout batch / engines), then ``scorers`` run forward passes on their GPUs
    over each round's sequences, all at once."""

    actor: str
    engines: int
    tp: int
    live: int
    scorers: tuple[Placed, ...]
    samples: int
    prompt_tokens: int
    gen_tokens: int


@dataclass(frozen=True)
class Published:
    name: str
    source: str
    cluster: str  # "a800-80gb" (a100-80gb with A800's NVLink), "h100-96gb-500w" (torchtitan's), or a cluster file
    nodes: int
    stage: TrainStage | VllmStage
    measured_seconds: float
    note: str = ""


def _llama2(size: str, actor_gpus: int, critic_gpus: int, ref_gpus: int, reward_gpus: int, micro: int):
    arch = f"llama-{size}"
    return (Placed(arch, actor_gpus, micro), Placed(arch, critic_gpus, micro, critic=True),
            Placed(arch, ref_gpus, micro), Placed(arch, reward_gpus, micro, critic=True))


def _train(size: str, actor_gpus: int, critic_gpus: int, micro: int, concurrent: bool) -> TrainStage:
    """OpenRLHF's training, as its scripts run it: ZeRO-2 for 7B and 13B, ZeRO-3 at 70B, AdamW on the host. At 34B
    the table's 2 actor GPUs cannot hold ZeRO-2's whole bf16 copy and half of the gradients (68 + 34 GB > 80 GB; the
    34B script's own ZeRO-2 ran the actor on 4), so that row ran ZeRO-3."""
    zero = 3 if size in ("34b", "70b") else 2
    models = tuple(dataclasses.replace(p, zero_stage=zero, offload_optimizer=True)
                   for p in _llama2(size, actor_gpus, critic_gpus, 1, 1, micro)[:2])
    return TrainStage(models, samples=1024, train_batch=128, seq_tokens=2048, concurrent=concurrent)


def _dschat(size: str, micro: int, offload: bool) -> TrainStage:
    """DeepSpeed-Chat's step 3 on 8 GPUs: actor ZeRO-2, critic ZeRO-3; ``--offload``: both optimizers on the host and
    the critic's parameters too."""
    actor, critic, _, _ = _llama2(size, 8, 8, 1, 1, micro)
    models = (dataclasses.replace(actor, zero_stage=2, offload_optimizer=offload),
              dataclasses.replace(critic, zero_stage=3, offload_optimizer=offload, offload_params=offload))
    return TrainStage(models, samples=1024, train_batch=128, seq_tokens=2048, concurrent=False)


def _vllm(size: str, engines: int, tp: int, actor_gpus: int, micro: int, ref_reward_gpus: int,
          critic_gpus: int) -> VllmStage:
    scorers = _llama2(size, actor_gpus, critic_gpus, ref_reward_gpus, ref_reward_gpus, micro)
    return VllmStage(f"llama-{size}", engines, tp, live=actor_gpus * micro // engines, scorers=scorers, samples=1024,
                     prompt_tokens=1024, gen_tokens=1024)


POINTS: tuple[Published, ...] = (
    Published("openrlhf-ray-vllm-7b-generation", OPENRLHF, "a800-80gb", 1, _vllm("7b", 2, 1, 2, 16, 1, 2), 481.86,
              "vLLM: 2 engines of 1 GPU; micro_rollout_batch 16 per actor rank (2 ranks)"),
    Published("openrlhf-ray-vllm-13b-generation", OPENRLHF, "a800-80gb", 1, _vllm("13b", 2, 1, 2, 8, 1, 2), 1425.75,
              "vLLM: 2 engines of 1 GPU; micro_rollout_batch 8"),
    Published("openrlhf-ray-vllm-70b-generation", OPENRLHF, "a800-80gb", 2, _vllm("70b", 2, 2, 4, 4, 2, 4), 7122.65,
              "vLLM: 2 engines of TP 2 (the 70B script); micro_rollout_batch 4"),
    Published("deepspeed-chat-7b-training", OPENRLHF, "a800-80gb", 1, _dschat("7b", 8, offload=True), 492.01,
              "DeepSpeed-Chat w/ offload, hybrid engine off, actor (ZeRO-2) then critic (ZeRO-3) on all 8 GPUs, "
              "micro-batch 8"),
    Published("openrlhf-7b-training", OPENRLHF, "a800-80gb", 1, _train("7b", 8, 8, 8, False), 256.97,
              "OpenRLHF without Ray: actor then critic on all 8 GPUs, micro_train_batch 8"),
    Published("openrlhf-ray-7b-training", OPENRLHF, "a800-80gb", 1, _train("7b", 4, 2, 8, True), 395.69,
              "OpenRLHF Ray 1:1:4:2: actor on 4 GPUs, critic on 2, at once"),
    Published("openrlhf-ray-vllm-7b-training", OPENRLHF, "a800-80gb", 1, _train("7b", 2, 2, 8, True), 403.29,
              "OpenRLHF Ray+vLLM 1:1:2:2:2: actor on 2 GPUs, critic on 2, at once"),
    Published("deepspeed-chat-13b-training", OPENRLHF, "a800-80gb", 1, _dschat("13b", 2, offload=True), 1218.76,
              "DeepSpeed-Chat w/ offload, actor (ZeRO-2) then critic (ZeRO-3) on all 8 GPUs, micro-batch 2"),
    Published("openrlhf-ray-13b-training", OPENRLHF, "a800-80gb", 1, _train("13b", 4, 2, 4, True), 949.10,
              "OpenRLHF Ray 1:1:4:2, micro_train_batch 4"),
    Published("openrlhf-ray-vllm-13b-training", OPENRLHF, "a800-80gb", 1, _train("13b", 2, 2, 4, True), 967.15,
              "OpenRLHF Ray+vLLM 1:1:2:2:2, micro_train_batch 4"),
    Published("openrlhf-ray-vllm-70b-training", OPENRLHF, "a800-80gb", 2, _train("70b", 4, 4, 4, True), 2699.97,
              "OpenRLHF Ray+vLLM 2:2:4:4:4 on 16 GPUs: actor on 4, critic on 4, micro_train_batch 4"),
    Published("torchtitan-llama3.1-8b-fsdp-8gpu", TORCHTITAN, "h100-96gb-500w", 1,
              TrainStage((Placed("llama-3.1-8b", 8, 2),), samples=16, train_batch=16, seq_tokens=8192,
                         concurrent=False, gradient_checkpointing=False), 2 * 8192 / 5762,
              "Table 1, FSDP (eager, no torch.compile): 5,762 tokens/s/GPU, local batch 2 x 8,192 tokens; "
              "selective activation checkpointing costed as none"),
    Published("torchtitan-llama3.1-8b-fsdp-128gpu", TORCHTITAN, "h100-96gb-500w", 16,
              TrainStage((Placed("llama-3.1-8b", 128, 2),), samples=256, train_batch=256, seq_tokens=8192,
                         concurrent=False, gradient_checkpointing=False), 2 * 8192 / 5605,
              "Table 3, FSDP (eager): 5,605 tokens/s/GPU, local batch 2 x 8,192 tokens"),
    # Added 2026-11-26 after the 13 above, in this order, before any was predicted (the split takes every other point
    # of this tuple, so they fall where their place puts them).
    Published("deepspeed-chat-7b-training-no-offload", OPENRLHF, "a800-80gb", 1, _dschat("7b", 4, offload=False),
              209.05, "DeepSpeed-Chat w/o offload (dbdd43b0), actor (ZeRO-2) then critic (ZeRO-3), micro-batch 4"),
    Published("openrlhf-ray-vllm-34b-training", OPENRLHF, "a800-80gb", 1, _train("34b", 2, 2, 2, True), 3296.18,
              "OpenRLHF Ray+vLLM 1:1:2:2:2, CodeLlama-34B: actor on 2 GPUs, critic on 2, micro_train_batch 2"),
)
