"""The step loop: the worker, op dispatch, running MFCs, evaluation, multi-turn episodes, partial rollouts."""
