"""async-vapo: asynchronous actor-learner RL with VAPO."""

__version__ = "0.1.0"
