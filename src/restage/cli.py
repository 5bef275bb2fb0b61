"""``restage plan|run|submit|sweep|status|cancel|report|profile|generate|merge-lora``.

Each command lives in the module that owns it; that module exposes ``add_arguments(parser)``
and ``main(args) -> int``. Only the chosen command's module is imported, so ``restage report``
does not pay for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from restage.disk import is_disk_full, place
from restage.errors import RestageError

COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("restage.plan.cli", "search an execution plan and write schedule.json"),
    "run": ("restage.launch.local", "plan (or read a schedule) and run the job locally with mpirun"),
    "submit": ("restage.launch.submit", "write and submit a SLURM job with submitit"),
    "sweep": ("restage.launch.sweep", "submit a grid of configs as one SLURM job array"),
    "status": ("restage.launch.status", "show the SLURM state of a run or sweep"),
    "cancel": ("restage.launch.status", "cancel the SLURM jobs of a run or sweep"),
    "report": ("restage.report.cli", "throughput report and plots from a run's log.h5"),
    "profile": ("restage.plan.profiler", "time model pieces on this device and store a profile"),
    "generate": ("restage.launch.generate", "generate text from a HF model directory"),
    "merge-lora": ("restage.models.lora_checkpoint", "merge saved LoRA adapters into a HF checkpoint"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
        print("usage: restage COMMAND [options]\n\ncommands:\n" + "\n".join(lines), file=sys.stderr if argv else sys.stdout)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"restage: error: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    command = argv[0]
    module = importlib.import_module(COMMANDS[command][0])
    parser = argparse.ArgumentParser(prog=f"restage {command}", description=COMMANDS[command][1])
    adder = getattr(module, f"add_{command}_arguments", None) or module.add_arguments
    adder(parser)
    args = parser.parse_intermixed_args(argv[1:])
    runner = getattr(module, f"{command}_main", None) or module.main
    try:
        return int(runner(args) or 0)
    except RestageError as err:
        print(f"restage: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a write of the command's own (config.yaml, schedule.json, plots) on a full disk

        if not is_disk_full(err):
            raise
        where = place(err.filename) if err.filename else "the disk"
        print(f"restage: error: no space left on {where} while writing {err.filename or 'a file'}; free space there",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("restage: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
