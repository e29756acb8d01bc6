"""Verifiable tasks: the built-in chain-arithmetic generator and loaders for local problem files.

Nothing here imports torch; ``pyarrow`` is imported only when a Parquet file is read.
"""

from async_vapo.tasks import arith
from async_vapo.tasks.base import Problem, prompt_uid
from async_vapo.tasks.files import ProblemFileError, load_problems

__all__ = ["Problem", "ProblemFileError", "arith", "load_problems", "prompt_uid"]
