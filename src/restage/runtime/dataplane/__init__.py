"""The data plane: data transfer between MFCs, parameter reallocation, sample routing, async mode's rollout buffer."""
