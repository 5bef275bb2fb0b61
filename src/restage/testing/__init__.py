"""Test support shipped with the package: NCCL's rules checked on CPU."""
