"""The learner: VAPO updates on torch, checkpoints."""
