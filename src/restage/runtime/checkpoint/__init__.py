"""Checkpoints of a run: saving and resuming every model, optimizer, data cursor and RNG; whole-or-absent directories."""
