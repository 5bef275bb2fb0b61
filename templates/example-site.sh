# Example preamble for a GPU site; copy it to templates/<your-site>.sh and set slurm.template=<your-site>.
# Every double-brace placeholder must have a value: the job's own ones (experiment, nodes, ranks_per_node,
# gpus_per_node, world_size, partition, account, python, venv, repo) or slurm.template_vars.NAME.
#
#   slurm.template_vars: {cuda_module: cuda/12.4, nccl_module: nccl/2.21, container_image: /images/restage.sqsh,
#                         ib_interface: ib0}

# Modules: a clean environment with the site's CUDA and NCCL.
module purge
module load {{ cuda_module }} {{ nccl_module }}

# Environment: the project's venv, NCCL over InfiniBand. No OMP_NUM_THREADS: each rank runs as many torch
# threads as it has cores (the driver binds each rank to its own; run.threads_per_rank sets another count).
source {{ venv }}/bin/activate
export NCCL_SOCKET_IFNAME={{ ib_interface }}
export NCCL_IB_DISABLE=0
export NCCL_DEBUG=WARN
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1

# Container flags: with slurm.launcher=srun (pyxis/enroot), each rank runs inside the image;
# RESTAGE_SRUN_ARGS is appended to the srun line that starts the ranks.
export RESTAGE_SRUN_ARGS="--container-image={{ container_image }} --container-mounts={{ repo }}:{{ repo }} --no-container-mount-home"
# With Apptainer instead, prefix each rank's command:
# export RESTAGE_RANK_PREFIX="apptainer exec --nv {{ container_image }}"
