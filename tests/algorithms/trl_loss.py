"""TRL's GRPOTrainer loss and gradients on a fixed batch; run by test_trl_parity_on_cpu.py in bench/.venv-trl.

Usage: ``bench/.venv-trl/bin/python tests/algorithms/trl_loss.py ARGS_JSON``; ARGS_JSON names the model directory,
the batch file (``torch.save`` of prompt/completion ids and masks, advantages, old and reference log-probs), the
output file and the cases. For each case a real ``GRPOTrainer`` (trl==1.16.0) is built with that ``loss_type``,
``importance_sampling_level``, ``epsilon``/``epsilon_high`` and ``beta``, and its own ``compute_loss`` runs on the
batch (``_compute_loss``: its log-prob forward, ratio, clipping, KL and aggregation); ``loss.backward()`` gives the
gradients. Writes ``{case: {"loss": tensor, "grads": {name: tensor}}}`` with ``torch.save``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")


def zero_reward(prompts, completions, **_) -> list[float]:
    return [0.0 for _ in prompts]


def main() -> int:
    args = json.loads(sys.argv[1])
    import torch
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(1)
    transformers.utils.logging.set_verbosity_error()
    batch = torch.load(args["batch"])
    n, width = batch["completion_ids"].shape
    results = {}
    for case in args["cases"]:
        model = transformers.AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(args["model"])
        config = GRPOConfig(
            output_dir=tempfile.mkdtemp(), use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
            bf16=False, gradient_checkpointing=False, per_device_train_batch_size=n, num_generations=args["group_size"],
            steps_per_generation=1, gradient_accumulation_steps=1, max_completion_length=width, temperature=1.0,
            loss_type=case["loss_type"], importance_sampling_level=case["level"], epsilon=case["epsilon"],
            epsilon_high=case["epsilon_high"], beta=case["beta"],
            # TRL 1.16 defaults to DeepSeek-V3.2's ratio-weighted KL; restage's GRPO KL is the plain k3 per token.
            use_bias_correction_kl=False)
        trainer = GRPOTrainer(model=model, reward_funcs=zero_reward, args=config, processing_class=tokenizer,
                              train_dataset=Dataset.from_list([{"prompt": "x"}] * n))
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1  # what Trainer.training_step sets before compute_loss
        inputs = {k: batch[k] for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
                                        "advantages", "old_per_token_logps")}
        if case["beta"] != 0:
            inputs["ref_per_token_logps"] = batch["ref_per_token_logps"]
        inputs["num_items_in_batch"] = batch["completion_mask"].sum()  # the generation batch's tokens (dapo)
        trainer.model.zero_grad()
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
        results[case["name"]] = {"loss": loss.detach(),
                                 "grads": {k: p.grad.detach().clone() for k, p in trainer.model.named_parameters()}}
    torch.save(results, args["out"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
