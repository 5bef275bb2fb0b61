# Preamble for any SLURM cluster: nothing site-specific. Copy templates/example-site.sh for a real site.
# Placeholders (a name in double braces) come from the job (experiment, nodes, ranks_per_node, gpus_per_node,
# world_size, partition, account, python, venv, repo) and from slurm.template_vars.
export PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
