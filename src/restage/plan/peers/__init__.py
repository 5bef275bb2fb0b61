"""Peer systems' plans as restage's estimator sees them: their default layouts, their engines, the baselines."""
