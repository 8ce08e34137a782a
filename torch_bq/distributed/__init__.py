"""Tensor parallelism over ``torch.distributed`` for torch_bq's linears and the DSpark drafter.

* :func:`column_parallel`, :func:`row_parallel` — shard a full FP8Linear/FP4Linear/BF16Linear
  (any split, block-aligned or not; results equal one rank's);
* :func:`column_parallel_from_checkpoint`, :func:`row_parallel_from_checkpoint` — the same,
  each rank reading only its slices of the checkpoint;
* :func:`tensor_parallel` — shard a ``DrafterLayer``/``Drafter`` as docs/contract.md §5 describes;
* :mod:`torch_bq.distributed.sharding` — the communication-free part: which slice a rank
  holds and how a slice that starts mid-block is re-expressed exactly.

See docs/distributed.md.
"""

from .drafter import kv_head_range, local_config, tensor_parallel, tensor_parallel_from_checkpoint
from .linear import (
    REDUCTIONS,
    ColumnParallelLinear,
    RowParallelLinear,
    column_parallel,
    column_parallel_from_checkpoint,
    group_rank_and_size,
    row_parallel,
    row_parallel_from_checkpoint,
)
from .sharding import RowShard, column_shard, row_shard, split_range

__all__ = [
    "column_parallel",
    "row_parallel",
    "column_parallel_from_checkpoint",
    "row_parallel_from_checkpoint",
    "tensor_parallel",
    "tensor_parallel_from_checkpoint",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "RowShard",
    "column_shard",
    "row_shard",
    "split_range",
    "local_config",
    "kv_head_range",
    "group_rank_and_size",
    "REDUCTIONS",
]
