"""TRL's GRPOTrainer on restage's GRPO tiny job, for bench/e2e_cpu.py; runs in the benchmark's own venv.

Usage (bench/e2e_cpu.py does this): ``bench/.venv-trl/bin/python bench/_trl_grpo.py ARGS_JSON`` with
the model directory, prompts file, sizes and step counts in the JSON; prints one JSON line with
the timed generation rounds. Everything is local (HF_HUB_OFFLINE=1): the model is the tiny LLaMA
directory restage trains, the reward is restage's own Python sort reward, imported from src/.
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
    dataset = Dataset.from_list([{"prompt": r["prompt"]} for r in rows])
    model = transformers.AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args["model"])
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
        scale_rewards="group", learning_rate=args["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0, dataloader_num_workers=0,
    )
    steps: list[dict] = []  # one per optimizer step: its end time and what TRL logged for it

    class Timer(transformers.TrainerCallback):
        def on_step_end(self, args_, state, control, **kwargs):
            steps.append({"step": state.global_step, "end_seconds": time.perf_counter()})

        def on_log(self, args_, state, control, logs=None, **kwargs):
            if logs and steps and steps[-1]["step"] == state.global_step:
                steps[-1].update({k: float(logs[k]) for k in ("num_tokens", "reward", "completions/mean_length")
                                  if k in logs})

    trainer = GRPOTrainer(model=model, reward_funcs=sort_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Timer()])
    started = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - started
    print(json.dumps({"start_seconds": started, "steps": steps, "train_seconds": total,
                      "steps_per_round": minibatches, "completions_per_round": completions,
                      "torch": torch.__version__, "transformers": transformers.__version__,
                      "trl": __import__("trl").__version__, "threads": args["threads"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
