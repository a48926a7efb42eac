"""Running N ranks on one host through torch.distributed (NCCL on GPUs, gloo on CPUs).

    python -m dsv32ref.parallel --nproc 4 --model glm-5.2 --boundary narrow   # one sharded step per rank

`spawn(fn, world_size, *args)` starts the processes (torch.multiprocessing), initialises the default
process group over a free loopback port and calls fn(rank, world_size, *args) in each.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsv32ref.checks import check_int
from dsv32ref.config import PRESETS, reduced_moe
from dsv32ref.engine import BOUNDARIES, EngineConfig, LLMEngine, StepInput, TensorParallel, build_model, shard
from dsv32ref.graphs import CUDAGraphMode


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, backend: str, fn, args) -> None:
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def spawn(fn, world_size: int, *args, backend: str | None = None) -> None:
    check_int("spawn: world_size", world_size)
    backend = backend or ("nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo")
    mp.spawn(_entry, args=(world_size, free_port(), backend, fn, args), nprocs=world_size, join=True)


def _demo(rank: int, world_size: int, model: str, boundary: str, prompt_len: int) -> None:
    config = reduced_moe(model)
    device = f"cuda:{rank}" if dist.get_backend() == "nccl" else "cpu"
    m = shard(build_model(config, boundary, device, torch.bfloat16, seed=0), TensorParallel(rank, world_size))
    eng = LLMEngine(config, EngineConfig(boundary=boundary, mode=CUDAGraphMode.FULL_AND_PIECEWISE, max_model_len=512,
                                         max_num_seqs=16, max_num_batched_tokens=16, capture_sizes=[1, 2, 4, 8, 16]),
                    device=device, model=m)
    eng.capture()
    toks, how = eng.step(StepInput([(0, list(range(1, prompt_len + 1)), 0)]))
    if rank == 0:
        print(f"{world_size} ranks, {boundary}: first token {toks[0]} ({how})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--model", default="glm-5.2", choices=sorted(PRESETS))
    ap.add_argument("--boundary", default="narrow", choices=BOUNDARIES)
    ap.add_argument("--prompt-len", type=int, default=8)
    args = ap.parse_args()
    for flag, v, most in (("--nproc", args.nproc, None), ("--prompt-len", args.prompt_len, 16)):  # before spawning
        try:
            check_int(flag, v, high=most)
        except ValueError as e:
            ap.error(str(e))
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on shared hosts
    spawn(_demo, args.nproc, args.model, args.boundary, args.prompt_len)


if __name__ == "__main__":
    main()
