"""Horovod allreduce latency and bandwidth, 4 KiB to 256 MiB, fp32 and fp16 compression.

    python benchmarks/allreduce.py --np 2 --out results/allreduce.json

Bandwidth follows the convention of the standard collective benchmarks (nccl-tests, OSU): for a
message of S bytes taking t seconds, algorithmic bandwidth algbw = S / t and bus bandwidth
busbw = algbw * 2 (n - 1) / n, which for a ring allreduce is what each link carries and so
compares across rank counts. S is always the fp32 payload, also with fp16 compression (which
halves the bytes on the wire), so the two modes compare directly. Also measured: the real
gradient of the Nature CNN, reduced the way hvd.DistributedOptimizer does (one named allreduce
per parameter, fused by Horovod). The fusion threshold and cycle time in effect are recorded.

With --compressions, that gradient is also reduced once per repetition by each named
`distributed.compression` the way training reduces it (none/fp16: Horovod's fused allreduce;
powersgd/topk: hvd_rl.runtime.compression's reduce()), recording the time, the bytes each rank hands to the
collectives, the compression compute (time outside the collectives) and how busy the ranks kept
the CPUs (their CPU seconds over wall seconds x cores): benchmarks/compression_allreduce.py runs it
on 2, 4 and 8 simulated nodes to check the projection model. --no-sweep skips the size sweep.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import horovod.torch as hvd  # noqa: E402

from hvd_rl.runtime import distributed as dist  # noqa: E402
from hvd_rl.config import DistributedConfig  # noqa: E402
from hvd_rl.cluster.launch import launched, relaunch_under_mpirun  # noqa: E402
from hvd_rl.analysis.projection import interconnect_from_environment  # noqa: E402

DEFAULT_FUSION_THRESHOLD = 128 * 1024 * 1024  # Horovod 0.28 defaults (horovod/common/operations.cc)
DEFAULT_CYCLE_TIME_MS = 1.0


def timed(fn, reps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        hvd.allreduce(torch.zeros(1), name="bench.barrier")  # start together
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    # The slowest rank defines the collective's time.
    return hvd.allreduce(torch.tensor(times, dtype=torch.float64), op=hvd.Max, name="bench.times").tolist()


def bandwidths(size_bytes: int, seconds: float, ranks: int) -> tuple[float, float]:
    algbw = size_bytes / seconds
    return algbw, algbw * (2 * (ranks - 1) / ranks if ranks > 1 else 1.0)


def nature_cnn_gradients() -> list[tuple[str, torch.Tensor]]:
    import gymnasium as gym

    from hvd_rl.config import ModelConfig
    from hvd_rl.algorithms.models import build_model

    model = build_model(ModelConfig(kind="nature_cnn"), gym.spaces.Box(0, 255, (4, 84, 84), np.uint8),
                        gym.spaces.Discrete(18))
    return [(name, torch.randn_like(p)) for name, p in model.named_parameters()]


def compressed_reductions(names: list[str], grads: list[tuple[str, torch.Tensor]], reps: int,
                          powersgd_rank: int, topk_ratio: float) -> list[dict]:
    """One row per compression: the slowest rank's median time to reduce the whole gradient."""
    from hvd_rl.runtime.compression import PowerSGD, TopK
    from hvd_rl.runtime.distributed import CLOCK

    rows = []
    dense_bytes = sum(g.numel() * 4 for _, g in grads)
    for name in names:
        generator = torch.Generator().manual_seed(hvd.rank())  # rank-dependent gradients, as in training
        params = [torch.nn.Parameter(torch.zeros_like(g)) for _, g in grads]
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        if name in ("none", "fp16"):
            codec = hvd.Compression.fp16 if name == "fp16" else hvd.Compression.none

            def reduce(codec=codec, tag=name):
                # as hvd.DistributedOptimizer does: compress, one async allreduce per tensor (fused), decompress
                pending = []
                for i, p in enumerate(params):
                    wire, ctx = codec.compress(p.grad)
                    pending.append((hvd.allreduce_async(wire, name=f"c.{tag}.{i}", op=hvd.Average), ctx))
                for handle, ctx in pending:
                    codec.decompress(hvd.synchronize(handle), ctx)
                return dense_bytes // (2 if tag == "fp16" else 1)
        elif name == "powersgd":
            reduce = PowerSGD(params, rank=powersgd_rank, seed=1).reduce
        elif name == "topk":
            reduce = TopK(params, ratio=topk_ratio).reduce
        else:
            raise SystemExit(f"allreduce.py: unknown compression {name!r} (none, fp16, topk, powersgd)")
        sent = reduce()  # warm-up: PowerSGD's first Q, Horovod's response cache
        outside: list[float] = []  # per call, this rank's seconds in reduce() outside the collectives

        def measured(reduce=reduce):
            inside, start = CLOCK.compression_collective_seconds, time.perf_counter()
            reduce()
            outside.append(time.perf_counter() - start - (CLOCK.compression_collective_seconds - inside))

        cpu_before, wall_before = time.process_time(), time.perf_counter()
        times = timed(measured, reps, warmup=1)
        wall = time.perf_counter() - wall_before
        busy = hvd.allreduce(torch.tensor([time.process_time() - cpu_before]), op=hvd.Sum, name=f"c.{name}.cpu")
        compress = 0.0
        if name in ("powersgd", "topk"):  # the compression compute: median over the timed calls, mean over ranks
            compress = float(hvd.allreduce(torch.tensor([float(np.median(outside[1:]))]), op=hvd.Average,
                                           name=f"c.{name}.compress"))
        rows.append({"compression": name, "reps": reps, "latency_s": float(np.median(times)),
                     "min_latency_s": float(min(times)), "bytes_per_rank": int(sent), "dense_bytes": dense_bytes,
                     "time_compress_s": compress,
                     "cpu_busy": float(busy) / (wall * (os.cpu_count() or 1))})
        if hvd.rank() == 0:
            print(f"  {name:8s} {rows[-1]['latency_s'] * 1e3:9.2f} ms  {sent / 2**20:7.3f} MiB/rank  "
                  f"compress {compress * 1e3:6.2f} ms  cpu busy {rows[-1]['cpu_busy']:.2f}", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--np", type=int, default=2, help="ranks (the script starts mpirun itself)")
    parser.add_argument("--min-size", type=int, default=4 * 1024)
    parser.add_argument("--max-size", type=int, default=256 * 1024 * 1024)
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions (fewer for large sizes)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--compressions", default="", help="comma-separated: reduce the gradient with each")
    parser.add_argument("--no-sweep", action="store_true", help="skip the message-size sweep")
    parser.add_argument("--powersgd-rank", type=int, default=4)
    parser.add_argument("--topk-ratio", type=float, default=0.01)
    args = parser.parse_args()
    if not launched() and args.np > 1:
        return relaunch_under_mpirun(args.np)

    defaults = DistributedConfig()  # wait as the trainer does (yield, Horovod cycle time)
    dist.init(defaults.mpi_yield_when_idle, defaults.cycle_time_ms)
    torch.set_num_threads(1)
    ranks = hvd.size()
    for i in range(20):  # first collectives pay for Horovod's setup and response-cache warm-up
        hvd.allreduce(torch.ones(1024), name="bench.warmup")
    rows = []
    size = args.min_size
    while size <= args.max_size and not args.no_sweep:
        count = size // 4
        tensor = torch.ones(count, dtype=torch.float32)
        reps = max(3, min(args.reps, int(args.reps * (8 * 1024 * 1024) / size) or 3))
        for compression_name, compression in (("fp32", hvd.Compression.none), ("fp16", hvd.Compression.fp16)):
            def op(t=tensor, c=compression, n=f"bench.{size}.{compression_name}"):
                return hvd.allreduce(t, op=hvd.Sum, name=n, compression=c)

            times = timed(op, reps, warmup=2)
            median = float(np.median(times))
            algbw, busbw = bandwidths(size, median, ranks)
            rows.append({"bytes": size, "compression": compression_name, "reps": reps,
                         "latency_s": median, "min_latency_s": float(min(times)),
                         "algbw_GBps": algbw / 1e9, "busbw_GBps": busbw / 1e9})
            if hvd.rank() == 0:
                print(f"{size:>11d} B  {compression_name}  {median * 1e6:10.1f} us  "
                      f"algbw {algbw / 1e9:7.3f} GB/s  busbw {busbw / 1e9:7.3f} GB/s", flush=True)
        size *= 4

    grads = nature_cnn_gradients()
    grad_bytes = sum(g.numel() * 4 for _, g in grads)

    def reduce_gradients():
        handles = [hvd.allreduce_async(g, name=f"grad.{n}", op=hvd.Average) for n, g in grads]
        for h in handles:
            hvd.synchronize(h)

    times = timed(reduce_gradients, args.reps, warmup=3)
    median = float(np.median(times))
    algbw, busbw = bandwidths(grad_bytes, median, ranks)
    gradient = {"model": "nature_cnn (18 actions)", "tensors": len(grads), "bytes": grad_bytes,
                "latency_s": median, "algbw_GBps": algbw / 1e9, "busbw_GBps": busbw / 1e9}
    compressed = []
    if args.compressions:
        compressed = compressed_reductions([c for c in args.compressions.split(",") if c], grads, args.reps,
                                           args.powersgd_rank, args.topk_ratio)
    if hvd.rank() != 0:
        return 0
    print(f"Nature CNN gradient: {len(grads)} tensors, {grad_bytes / 2**20:.2f} MiB, "
          f"{median * 1e3:.2f} ms, busbw {busbw / 1e9:.3f} GB/s")
    result = {
        "kind": "hvd_rl.allreduce_benchmark", "ranks": ranks, "nodes": hvd.cross_size(),
        "interconnect": interconnect_from_environment() if hvd.cross_size() > 1 else "",
        "controller": "mpi" if hvd.mpi_enabled() else "gloo", "rows": rows, "gradient": gradient,
        "compressed": compressed, "powersgd_rank": args.powersgd_rank, "topk_ratio": args.topk_ratio,
        "fusion_threshold_bytes": int(os.environ.get("HOROVOD_FUSION_THRESHOLD", DEFAULT_FUSION_THRESHOLD)),
        "cycle_time_ms": float(os.environ.get("HOROVOD_CYCLE_TIME", DEFAULT_CYCLE_TIME_MS)),
        "mpi_yield_when_idle": os.environ.get(dist.YIELD_VAR),
        "busbw_factor": "2(n-1)/n", "machine": {"hostname": platform.node(), "cpus": os.cpu_count(),
                                                "torch": torch.__version__},
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
