"""Verifiable tasks: the built-in chain-arithmetic and word-problem generators and loaders for local problem files.

Nothing here imports torch; ``pyarrow`` is imported only when a Parquet file is read.
"""

from async_vapo.tasks import arith, wordprob
from async_vapo.tasks.files import ProblemFileError, load_problems
from async_vapo.tasks.sampler import PromptSampler, load_task
from async_vapo.tasks.task import Problem, prompt_uid

__all__ = ["Problem", "ProblemFileError", "PromptSampler", "arith", "load_problems", "load_task", "prompt_uid",
           "wordprob"]
