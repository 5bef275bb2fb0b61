"""restage: RLHF training with a parallel layout per stage and parameter reallocation between layouts."""

__version__ = "0.1.0"
