"""Context parallelism: one memory's forward and backward over one sequence split into contiguous
shards on the ranks of a ``torch.distributed`` group (gloo on CPU, nccl on CUDA).

* :func:`parallel_plan` -- which path a memory takes and why (the state maps' scan, or the relay);
* :func:`context_parallel` / :class:`ContextParallel` -- run it;
* :func:`shard` / :func:`shard_bounds` -- this rank's contiguous piece of a sequence.

See docs/parallel.md.
"""
from .documents import local_documents
from .maps import shard_bounds
from .plan import Group, ParallelPlan, parallel_plan
from .run import ContextParallel, context_parallel, shard

__all__ = ["ContextParallel", "Group", "ParallelPlan", "context_parallel", "local_documents", "parallel_plan", "shard", "shard_bounds"]
