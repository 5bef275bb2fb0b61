"""Published measurements of RLHF stages and LLM training on A100/A800/H100, with the workload each ran.

Every entry names its source and the exact work: model, GPUs, batch, prompt and answer lengths, and
the system's plan and engine. ``bench/calibration.py`` predicts each with restage's cost model and
prints the error. Stages a system runs as restage's runtime does (DeepSpeed ZeRO-3 training, eager
PyTorch) are predicted with restage's own model; generation the system runs with vLLM is predicted
with ``plan/engines.py``'s vLLM model.

OpenRLHF benchmark (OPENRLHF): A800-SXM-80GB (A100 compute and HBM, NVLink 400 GB/s in total), one
PPO pass over 1,024 prompts of 1,024 tokens with 1,024-token answers (deepspeed-chat's benchmark
setting: fixed-length answers), train_batch_size 128 (8 optimizer steps per model), actor, critic,
reference and reward all LLaMA-2 of the same size, ZeRO-3, gradient checkpointing (the published
training TFLOP/s, e.g. 115.5 per GPU x 8 GPUs x 257 s = 2.37e17 FLOP for the 7B actor and critic, match
8 x params x 2.1M tokens x 2 models = 2.25e17 only with recomputation). GPU counts follow from the
published end-to-end TFLOP/s: the same work at the same FLOP count gives 8 GPUs for every 7B and 13B
row (1:1:2:2:2 = ref:reward:actor:critic:vLLM GPUs) and 16 for 70B (2:2:4:4:4). "Generation" is
OpenRLHF's make-experience phase: vLLM generation of each micro-rollout batch, then the actor's,
reference's, reward's and critic's forward passes over it.
"""

from __future__ import annotations

from dataclasses import dataclass

OPENRLHF = "https://github.com/OpenRLHF/OpenRLHF/blob/main/benchmark/README.md (A800, vLLM 0.3.1, DeepSpeed 0.13.2)"
TORCHTITAN = ("https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md "
              "(H100 96GB HBM2e 2.4 TB/s, 500 W)")


@dataclass(frozen=True)
class Placed:
    """One model of a stage on ``gpus`` devices (ZeRO-3 data parallel), with its micro-batch per device."""

    arch: str
    gpus: int
    micro_batch: int
    critic: bool = False


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
    actor, critic, _, _ = _llama2(size, actor_gpus, critic_gpus, 1, 1, micro)
    return TrainStage((actor, critic), samples=1024, train_batch=128, seq_tokens=2048, concurrent=concurrent)


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
    Published("openrlhf-ray-vllm-70b-generation", OPENRLHF, "a800-80gb", 2, _vllm("70b", 1, 4, 4, 4, 2, 4), 7122.65,
              "vLLM: 1 engine of 4 GPUs (TP 4, our reading of 4 vLLM GPUs); micro_rollout_batch 4"),
    Published("deepspeed-chat-7b-training", OPENRLHF, "a800-80gb", 1, _train("7b", 8, 8, 8, False), 492.01,
              "DeepSpeed-Chat, hybrid engine off, actor then critic on all 8 GPUs, micro_train_batch 8"),
    Published("openrlhf-7b-training", OPENRLHF, "a800-80gb", 1, _train("7b", 8, 8, 8, False), 256.97,
              "OpenRLHF without Ray: actor then critic on all 8 GPUs, micro_train_batch 8"),
    Published("openrlhf-ray-7b-training", OPENRLHF, "a800-80gb", 1, _train("7b", 4, 2, 8, True), 395.69,
              "OpenRLHF Ray 1:1:4:2: actor on 4 GPUs, critic on 2, at once"),
    Published("openrlhf-ray-vllm-7b-training", OPENRLHF, "a800-80gb", 1, _train("7b", 2, 2, 8, True), 403.29,
              "OpenRLHF Ray+vLLM 1:1:2:2:2: actor on 2 GPUs, critic on 2, at once"),
    Published("deepspeed-chat-13b-training", OPENRLHF, "a800-80gb", 1, _train("13b", 8, 8, 2, False), 1218.76,
              "DeepSpeed-Chat, actor then critic on all 8 GPUs, micro_train_batch 2"),
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
)
