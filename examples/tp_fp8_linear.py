"""A tensor-parallel fp8 MLP loaded from a checkpoint, each rank reading only its slices.

Run from the repository root (see docs/distributed.md)::

    python -m examples.tp_fp8_linear --write /tmp/tp_fp8.safetensors
    torchrun --standalone --nproc-per-node 4 -m examples.tp_fp8_linear /tmp/tp_fp8.safetensors

``up`` ([96, 256], fp8 32x32 blocks) is column-parallel without gather: 96 rows over
4 ranks is 24 rows a rank, so three of the four shards start inside a scale block.
``down`` ([256, 96]) is row-parallel on those 24 columns; its partial sums are
all-reduced, and its activation quantization exchanges the maxima of the 32-wide
blocks that two ranks share. Rank 0 then loads the whole layers and compares.
"""

import argparse

import torch
import torch.distributed as dist

from torch_bq import formats
from torch_bq.distributed import column_parallel_from_checkpoint, row_parallel_from_checkpoint
from torch_bq.nn import FP8Linear


def write_checkpoint(path: str, hidden: int = 256, ffn: int = 96) -> None:
    """A small checkpoint: ``up.weight``/``up.weight_scale`` [ffn, hidden], ``down.*`` [hidden, ffn]."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, (n, k) in {"up": (ffn, hidden), "down": (hidden, ffn)}.items():
        weight, scale = formats.quantize_fp8(torch.randn(n, k, generator=gen) / k**0.5, (32, 32))
        tensors[f"{name}.weight"], tensors[f"{name}.weight_scale"] = weight, scale
    save_file(tensors, path)


def run(path: str, verbose: bool = True) -> float:
    """Run the sharded MLP on every rank; return max |TP - one rank| / max |one rank| (rank 0 checks)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    up = column_parallel_from_checkpoint(path, "up", gather_output=False)
    down = row_parallel_from_checkpoint(path, "down", input_is_parallel=True)
    x = torch.randn(8, up.in_features, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    y = down(torch.relu(up(x)))  # every rank gets the full [8, 256]
    if verbose:
        print(f"rank {rank}/{size}: up {up.extra_repr()}; local block {up.local.block}; "
              f"down columns [{down.k0}, {down.k1}); y {tuple(y.shape)}", flush=True)
    err = torch.zeros(1)
    if rank == 0:
        ref = FP8Linear.from_checkpoint(path, "down")(torch.relu(FP8Linear.from_checkpoint(path, "up")(x)))
        err[0] = ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
        if verbose:
            print(f"max |TP - single rank| / max |single rank| = {err.item():.2e}", flush=True)
    dist.broadcast(err, src=0)
    return err.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--write", action="store_true", help="write the small checkpoint and exit")
    args = parser.parse_args()
    if args.write:
        write_checkpoint(args.checkpoint)
        return
    dist.init_process_group("gloo")  # torchrun provides MASTER_ADDR/PORT, RANK, WORLD_SIZE
    try:
        run(args.checkpoint)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
