# Preamble for the one-node cluster that scripts/slurm_local.sh starts on this machine (tests, CI).
# The job runs from the submitting shell's environment (sbatch exports it), so the venv is already on PATH.
export PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=1
# CPU ranks: torch.distributed uses gloo over loopback.
export GLOO_SOCKET_IFNAME=lo
