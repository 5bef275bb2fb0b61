"""TRL's GRPOTrainer on one of restage's GRPO jobs, for bench/e2e_cpu.py; runs in the benchmark's own venv.

Usage (bench/e2e_cpu.py does this): ``bench/.venv-trl/bin/python bench/_trl_grpo.py ARGS_JSON`` with
the model directory, prompts file, sizes and step counts in the JSON; prints one JSON line with
the timed generation rounds and timed spans of GRPOTrainer's own methods. Everything is local
(HF_HUB_OFFLINE=1): the model is the LLaMA directory restage trains, the reward is restage's own Python
sort reward, imported from src/.

Each setting below is TRL 1.16.0's (trl/trainer/grpo_config.py, grpo_trainer.py):

* ``beta`` is the KL coefficient; at 0 ``GRPOTrainer.__init__`` sets ``ref_model = None`` ("If beta is 0.0,
  the reference model is not needed"; the config's help: "the reference model is not loaded").
* ``steps_per_generation`` optimizer steps per generation round with ``gradient_accumulation_steps=1``:
  ``_prepare_inputs`` generates every ``generate_every = steps_per_generation * num_iterations`` steps and splits
  the round's completions into that many batches. ``_generate_and_score_completions`` makes an old-policy
  log-prob pass (a no-grad forward of the policy over the round's completions) unless
  ``gradient_accumulation_steps % generate_every == 0``: so with one optimizer step per round
  (``grpo_256x4``) it makes none (``old_per_token_logps = None``; the loss uses the detached current
  log-probs), and with two (``grpo_tiny``'s ``minibatches: 2``; 1 % 2 != 0) it makes one per round, where
  restage's GRPO takes the sampling log-probs as the old ones and makes no such pass. It is TRL's own cost
  of doing that job, so it stays in TRL's time, timed as ``old_logprobs`` (apart from ``reference_logprobs``).
* Generation (no vLLM: ``use_vllm=False`` by default) is ``model.generate`` with ``GenerationConfig(do_sample=True,
  max_new_tokens=max_completion_length, temperature, top_p, top_k, min_p, eos_token_id=[the tokenizer's EOS,
  ...])``: every answer stops at EOS or ``max_completion_length``, as restage's do.
* ``loss_type="grpo"``, ``scale_rewards="group"`` (restage's GRPO: group-normalised advantages, per-sequence
  mean of the token losses), ``epsilon`` the clip range, AdamW (TrainingArguments' ``adamw_torch``) with
  restage's betas, weight decay and gradient clip, a constant learning rate.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from restage.data.tasks import score  # noqa: E402  (pure Python, no restage dependencies)

SPANS: list[tuple[str, float, float]] = []  # (name, start, end) of every timed call, perf_counter seconds


def sort_reward(prompts, completions, **_) -> list[float]:
    return [score(p, c) for p, c in zip(prompts, completions, strict=True)]


def main() -> int:
    args = json.loads(sys.argv[1])
    import torch
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args["threads"])
    torch.manual_seed(args["seed"])
    transformers.utils.logging.set_verbosity_error()
    rows = [json.loads(line) for line in Path(args["prompts"]).read_text().splitlines() if line.strip()]
    model = transformers.AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args["model"])
    # restage's prompts start with BOS (data/datasets.prompt_ids); this tokenizer adds none, so the text carries it
    # and both sides feed the model the same ids ("[BOS] sort 6 0 :" -> 1 14 10 4 15, as restage's).
    dataset = Dataset.from_list([{"prompt": tokenizer.bos_token + " " + r["prompt"]} for r in rows])
    group, prompts, minibatches = args["group_size"], args["prompts_per_step"], args["minibatches"]
    completions = group * prompts
    config = GRPOConfig(
        output_dir=args["output_dir"], use_cpu=True, seed=args["seed"], report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True,
        # TRL defaults both on; restage's tiny jobs train in fp32 without recomputation, and so does this.
        bf16=False, gradient_checkpointing=False,
        # One generation round of `prompts` x `group` completions, then `minibatches` optimizer steps on it.
        per_device_train_batch_size=completions // minibatches, steps_per_generation=minibatches,
        gradient_accumulation_steps=1, num_generations=group, num_iterations=1,
        max_steps=args["rounds"] * minibatches, max_completion_length=args["max_new_tokens"],
        temperature=args["temperature"], beta=args["kl_coef"], epsilon=args["clip_eps"], loss_type="grpo",
        top_k=args["top_k"], top_p=args["top_p"],
        scale_rewards="group", learning_rate=args["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=args["weight_decay"], adam_beta1=args["betas"][0], adam_beta2=args["betas"][1],
        max_grad_norm=args["max_grad_norm"], dataloader_num_workers=0,
    )
    steps: list[dict] = []  # one per optimizer step: its end time and what TRL logged for it

    class Timer(transformers.TrainerCallback):
        def on_step_end(self, args_, state, control, **kwargs):
            steps.append({"step": state.global_step, "end_seconds": time.perf_counter()})

        def on_pre_optimizer_step(self, args_, state, control, **kwargs):
            self.optimizer_started = time.perf_counter()

        def on_optimizer_step(self, args_, state, control, **kwargs):
            SPANS.append(("optimizer", self.optimizer_started, time.perf_counter()))

        def on_log(self, args_, state, control, logs=None, **kwargs):
            if logs and steps and steps[-1]["step"] == state.global_step:
                steps[-1].update({k: float(logs[k]) for k in ("num_tokens", "reward", "completions/mean_length")
                                  if k in logs})

    trainer = GRPOTrainer(model=model, reward_funcs=sort_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Timer()])
    time_methods(trainer)
    started = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - started
    print(json.dumps({"start_seconds": started, "steps": steps, "train_seconds": total, "spans": SPANS,
                      "steps_per_round": minibatches, "completions_per_round": completions,
                      "torch": torch.__version__, "transformers": transformers.__version__,
                      "trl": __import__("trl").__version__, "threads": args["threads"]}))
    return 0


def time_methods(trainer) -> None:
    """Time GRPOTrainer's own steps from outside: each wrapped method's calls are appended to SPANS.

    rollout: ``_generate_and_score_completions`` (called from ``_prepare_inputs`` inside ``training_step``);
    within it generation (``_generate``), rewards (``_calculate_rewards``) and the no-grad
    ``_get_per_token_logps_and_entropies`` passes it makes, named by the model they run: ``reference_logprobs``
    on ``trainer.ref_model`` (beta > 0), ``old_logprobs`` on the policy itself (the old-policy pass; without
    PEFT, the reference pass never runs on the policy); training_step: the whole of ``training_step`` (the
    rollout, when due, then forward, loss and backward); grad_clip: ``_clip_grad_norm``. The optimizer step is
    timed by the Timer callback.
    """
    in_rollout = [False]

    def timed(name: str, method):
        def call(*a, **k):
            began = time.perf_counter()
            try:
                return method(*a, **k)
            finally:
                SPANS.append((name, began, time.perf_counter()))
        return call

    rollout = timed("rollout", trainer._generate_and_score_completions)

    def timed_rollout(*a, **k):
        in_rollout[0] = True
        try:
            return rollout(*a, **k)
        finally:
            in_rollout[0] = False

    logprobs = trainer._get_per_token_logps_and_entropies
    passes = {name: timed(name, logprobs) for name in ("reference_logprobs", "old_logprobs")}

    def timed_logprobs(model, *a, **k):
        if not in_rollout[0]:
            return logprobs(model, *a, **k)  # the training forward (compute_loss): part of training_step
        return passes["reference_logprobs" if model is trainer.ref_model else "old_logprobs"](model, *a, **k)

    trainer._generate_and_score_completions = timed_rollout
    trainer._generate = timed("generation", trainer._generate)
    trainer._calculate_rewards = timed("rewards", trainer._calculate_rewards)
    trainer._get_per_token_logps_and_entropies = timed_logprobs
    trainer.training_step = timed("training_step", trainer.training_step)
    trainer._clip_grad_norm = timed("grad_clip", trainer._clip_grad_norm)  # between training_step and the optimizer


if __name__ == "__main__":
    sys.exit(main())
