"""``restage generate MODEL_DIR --prompt TEXT ... [--tp N] [--pp N] [--ep N] [-n NPROC] [--greedy] [--json]``.

Generates from a HF model directory on this machine. It lives in ``launch/`` because it starts
ranks under ``mpirun`` and joins them through the runtime's control plane; ``models/`` stays below
the runtime. With more than one process the command
re-launches itself under the environment's ``mpirun`` (N = dp * tp * pp ranks; the prompts are
dealt round-robin to the data-parallel replicas) and rank 0 prints the completions in prompt
order. Prompts are text (tokenised with the directory's tokenizer), token ids (``--token-ids``),
or a JSONL file of ``{"prompt": TEXT}`` / ``{"token_ids": [...]}`` lines. A text prompt is encoded
exactly as training encodes a data set's prompts (``data.chat.encode_prompt``: BOS, then the
tokens, cut from the left to ``--max-prompt-tokens`` as to ``dataset.max_prompt_tokens``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from restage.data.chat import encode_prompt
from restage.device import DTYPES, TORCH_NAMES, torch_dtype
from restage.errors import ConfigError, RestageError
from restage.launch.mpirun import mpirun_command
from restage.layout import Layout, ProcessGroups, Strategy
from restage.models.arch import ModelConfig
from restage.models.hf_checkpoint import load_stage
from restage.models.sharding import validate_strategy
from restage.models.tiny import quiet_transformers
from restage.rollout.generation import generate
from restage.rollout.sampling import SamplingParams, request_seed
from restage.runtime.control.channels import Control, init_torch_distributed

_ARGS_ENV = "RESTAGE_GENERATE_ARGS"
DTYPE_NAMES = tuple(TORCH_NAMES[dtype] for dtype in DTYPES.values())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", nargs="?", help="HF model directory (config.json + weights)")
    parser.add_argument("--model", dest="model_flag", help="the model directory, as a flag")
    parser.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    parser.add_argument("--prompts", help="JSONL file: one {\"prompt\": TEXT} or {\"token_ids\": [...]} per line")
    parser.add_argument("--token-ids", action="append", default=[], metavar="'ID ID ...'",
                        help="a prompt as space-separated token ids (repeatable); needs no tokenizer")
    parser.add_argument("--max-prompt-tokens", type=int, default=0,
                        help="cut text prompts from the left to this many tokens, BOS kept, as training's "
                             "dataset.max_prompt_tokens does (0: no cut)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--min-new-tokens", type=int, default=0)
    parser.add_argument("--greedy", action="store_true", help="argmax decoding instead of sampling")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0: off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1: off")
    parser.add_argument("--min-p", type=float, default=0.0, help="0: off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert-parallel degree (mixture-of-experts models): experts split over this many of the "
                             "data-parallel ranks; must divide the experts and -n / (tp*pp)")
    parser.add_argument("-n", "--nproc", type=int, default=None, help="processes (a multiple of tp*pp; default tp*pp)")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="float32")
    parser.add_argument("--json", action="store_true", help="print one JSON document with token ids, text and logprobs")


def _model_dir(args) -> Path:
    path = args.model_flag or args.model_dir
    if not path:
        raise ConfigError("no model given; pass MODEL_DIR or --model DIR")
    return Path(path)


def _read_prompts(args, tokenizer) -> tuple[list[list[int]], list[str | None]]:
    """Token ids and (when given as text) the text of every prompt, in order."""
    items: list[str | list[int]] = list(args.prompt)
    for text in args.token_ids:
        try:
            items.append([int(t) for t in text.replace(",", " ").split()])
        except ValueError:
            raise ConfigError(f"--token-ids {text!r} is not a list of integers") from None
    if args.prompts:
        try:
            lines = Path(args.prompts).read_text().splitlines()
        except OSError as err:
            raise ConfigError(f"cannot read --prompts {args.prompts}: {err.strerror}") from None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise ConfigError(f"{args.prompts}:{number} is not JSON; write {{\"prompt\": TEXT}} per line") from None
            if isinstance(row, str) or "prompt" in row:
                items.append(row if isinstance(row, str) else row["prompt"])
            elif "token_ids" in row:
                items.append([int(t) for t in row["token_ids"]])
            else:
                raise ConfigError(f"{args.prompts}:{number} needs a \"prompt\" or \"token_ids\" key")
    if not items:
        raise ConfigError("no prompts; pass --prompt TEXT, --token-ids 'IDS' or --prompts FILE.jsonl")
    ids: list[list[int]] = []
    texts: list[str | None] = []
    for item in items:
        if isinstance(item, str):
            if tokenizer is None:
                raise ConfigError("the model directory has no tokenizer; pass prompts as --token-ids")
            # Training's own encoding: BOS where the tokenizer has one (its add_special_tokens may not add it).
            limit = args.max_prompt_tokens or len(tokenizer.encode(item, add_special_tokens=False)) + 1
            ids.append(list(encode_prompt(tokenizer, item, limit)))
            texts.append(item)
        else:
            ids.append(item)
            texts.append(None)
    if any(not p for p in ids):
        raise ConfigError("a prompt is empty; every prompt needs at least one token")
    return ids, texts


def _tokenizer(path: Path):
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    return quiet_transformers().AutoTokenizer.from_pretrained(str(path))


def _check(args) -> tuple[int, object]:
    """Validate everything a user can get wrong before any process starts; returns (nproc, ModelConfig)."""
    path = _model_dir(args)
    cfg = ModelConfig.from_pretrained(path)
    if args.max_prompt_tokens < 0:
        raise ConfigError(f"--max-prompt-tokens {args.max_prompt_tokens} must be >= 1 (0: no cut)")
    ep = getattr(args, "ep", 1)
    nproc = args.nproc or args.tp * args.pp * ep
    if nproc % (args.tp * args.pp):
        raise ConfigError(f"-n {nproc} is not a multiple of tp*pp = {args.tp * args.pp}; use -n {args.tp * args.pp}")
    validate_strategy(cfg, _strategy(args, nproc), name=str(path))
    return nproc, cfg


def _strategy(args, world: int) -> Strategy:
    """The layout's strategy over ``world`` ranks: dp fills what tp and pp leave (ep is carved out of dp)."""
    return Strategy(dp=world // (args.tp * args.pp), tp=args.tp, pp=args.pp, ep=getattr(args, "ep", 1))


def main(args: argparse.Namespace) -> int:
    nproc, _ = _check(args)
    # Tokenise once, here: bad prompts fail in one process, and the ranks need no tokenizer to start.
    args.prompt_ids, args.prompt_texts = _read_prompts(args, _tokenizer(_model_dir(args)))
    under_mpi = "OMPI_COMM_WORLD_SIZE" in os.environ or "PMI_SIZE" in os.environ
    if nproc == 1 or under_mpi:
        return _run(args, nproc, use_mpi=under_mpi)
    env = {**os.environ, _ARGS_ENV: json.dumps(vars(args)), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    command = mpirun_command(nproc, [sys.executable, "-m", "restage.launch.generate"],
                             env=[_ARGS_ENV, "OMP_NUM_THREADS", "PYTHONPATH"] if "PYTHONPATH" in env else
                             [_ARGS_ENV, "OMP_NUM_THREADS"])
    return subprocess.run(command, env=env).returncode


class Completion(NamedTuple):
    """One prompt's answer as a DP rank sends it to rank 0 over MPI."""

    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]


def _run(args, nproc: int, use_mpi: bool) -> int:
    path = _model_dir(args)
    prompts, texts = args.prompt_ids, args.prompt_texts
    control = None
    rank, world = 0, 1
    if use_mpi:
        control = Control()
        rank, world = control.rank, control.world_size
        if world != nproc:
            raise ConfigError(f"running on {world} MPI ranks but -n {nproc}; make them agree")
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        init_torch_distributed(control, timeout_seconds=300)
    strategy = _strategy(args, world)
    layout = Layout(tuple(range(world)), strategy)
    groups = ProcessGroups(layout.all_groups()) if world > 1 else None
    module = load_stage(path, layout, groups, rank, dtype=torch_dtype(args.dtype))
    cfg = module.cfg
    eos = cfg.stop_token_ids
    params = SamplingParams(max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens, greedy=args.greedy,
                            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            seed=args.seed,
                            eos_token_ids=eos, pad_token_id=cfg.pad_token_id or 0)
    coord = layout.coord(rank)
    assert coord is not None  # the mesh is every rank
    mine = list(range(coord.dp, len(prompts), strategy.dp))
    rows: list[Completion] = []
    if mine or strategy.ep > 1:  # under ep a replica without prompts still serves its experts to its peers
        # Each prompt's noise is seeded by its index in the file, so the answers do not depend on dp.
        out = generate(module, [prompts[i] for i in mine], params, seeds=[request_seed(args.seed, i) for i in mine])
        rows = [Completion(i, ids, logprobs) for i, ids, logprobs in zip(mine, out.sequences(), out.token_logprobs())]
    if control is not None:
        gathered = control.gather(rows if coord.pp == 0 and coord.tp == 0 else [])
        rows = [row for part in gathered for row in part] if gathered is not None else []
        # Join gloo's worker threads now: left running into interpreter shutdown, one of them
        # released a tensor after Python had finalised and the rank aborted ("terminate called").
        dist.destroy_process_group()
        if rank != 0:
            return 0
    _print(args, sorted(rows), prompts, texts, _tokenizer(path), strategy)
    return 0


def _print(args, rows: list[Completion], prompts, texts, tokenizer, strategy) -> None:
    def text(ids):
        return tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else None

    completions = [{"prompt": texts[row.prompt_index], "prompt_token_ids": prompts[row.prompt_index],
                    "token_ids": row.token_ids, "text": text(row.token_ids),
                    "logprobs": [round(lp, 6) for lp in row.logprobs]} for row in rows]
    if args.json:
        print(json.dumps({"model": str(_model_dir(args)), "strategy": str(strategy), "completions": completions}))
        return
    for i, c in enumerate(completions):
        shown = c["text"] if c["text"] is not None else " ".join(map(str, c["token_ids"]))
        prompt = c["prompt"] if c["prompt"] is not None else " ".join(map(str, c["prompt_token_ids"]))
        print(f"[{i}] {prompt} -> {shown}")


if __name__ == "__main__":  # one rank of a multi-process run started by main()
    namespace = argparse.Namespace(**json.loads(os.environ[_ARGS_ENV]))
    try:
        sys.exit(_run(namespace, namespace.nproc or namespace.tp * namespace.pp * namespace.ep, use_mpi=True))
    except RestageError as err:
        print(f"restage: error: {err}", file=sys.stderr)
        sys.exit(2)
