"""The control plane: MPI messages, the master role, failure handling, clocks, rank processes and threads."""
