"""Why one rank stays below its one-core limit: a forward pass is slower when it does not follow
another forward pass.

    python benchmarks/interleave.py --out benchmarks/results/throughput/interleave.json

The machine limit in `benchmarks/throughput.py` adds up each part's rate measured alone, in a
loop that repeats that one part. The rollout cannot: every inference step follows an env step.
This benchmark times the rollout's forward pass, layer by layer (forward hooks on the inference
model), in one process pinned to one CPU with one thread, in these conditions:
  back to back   forward passes in a loop, nothing in between (what the inference probe does)
  after spin     after a 3 ms busy loop of the Python interpreter: no memory traffic, no other
                 thread, the core never idle
  after read     after summing an 8 MiB array (evicts the caches the forward pass would reuse)
  after sleep    after a 3 ms sleep (the core idles)
  in rollout     the trainer's own RolloutCollector.collect(): each forward follows an env step
The conditions rotate from round to round; the table gives medians over all forward passes of
all rounds. If "after spin" is as slow as "in rollout", the slowdown comes from switching away
from the forward pass for a few milliseconds, not from what the env step does to the caches.
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

from hvd_rl.config import load_config, validate  # noqa: E402
from hvd_rl.envs.vector import env_seeds  # noqa: E402
from hvd_rl.algorithms.rollout import RolloutBuffer, RolloutCollector  # noqa: E402
from throughput import one_thread_rank, repo_relative  # noqa: E402  (this script's folder is on sys.path)

GAP_S = 0.003
CONDITIONS = ("back to back", "after spin", "after read", "after sleep", "in rollout")


class LayerClock:
    """Per-layer wall times of `model`'s forward passes (forward hooks). Only full passes count:
    `model.value()` (the rollout's last observation) runs the layers without the model's own
    forward, so its layer hooks fire outside a pass and are ignored."""

    def __init__(self, model: torch.nn.Module):
        self.marks: list[tuple[str, float]] | None = None  # the pass in progress, else None
        self.passes: list[list[float]] = []
        self.layers: list[str] = []  # "name (type)" of each timed layer, in the order they run
        model.register_forward_pre_hook(self._start)
        model.register_forward_hook(self._end)
        for name, module in model.named_modules():
            if not list(module.children()) and not isinstance(module, torch.nn.ReLU):
                module.register_forward_hook(self._marker(f"{name} ({type(module).__name__})"))

    def _start(self, *_) -> None:
        self.marks = [("start", time.perf_counter())]

    def _marker(self, label: str):
        def mark(*_) -> None:
            if self.marks is not None:
                self.marks.append((label, time.perf_counter()))
        return mark

    def _end(self, *_) -> None:
        self.marks.append(("end", time.perf_counter()))
        order = [label for label, _ in self.marks[1:-1]]
        self.layers = self.layers or order
        assert order == self.layers, f"layers ran in a different order: {order}"
        self.passes.append([t for _, t in self.marks])
        self.marks = None

    def take(self) -> np.ndarray:
        """[passes, layers + 1] seconds: each layer (with what runs between it and the previous
        layer's end: the input's preparation before the first), then the fp32 outputs after the
        last layer."""
        passes, self.passes = np.array(self.passes), []
        return np.diff(passes, axis=1)


def spin(seconds: float) -> None:
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        pass


def measure(args) -> dict:
    cpu = max(os.sched_getaffinity(0)) if args.cpu is None else args.cpu
    os.sched_setaffinity(0, {cpu})  # the env worker threads created below inherit it
    cfg = load_config(args.config, args.overrides)
    validate(cfg)
    envs, model = one_thread_rank(cfg)
    obs_space, action_space = envs.single_observation_space, envs.single_action_space
    n = cfg.env.num_envs
    buffer = RolloutBuffer(cfg.ppo.num_steps, n, obs_space, action_space, torch.device("cpu"))
    collector = RolloutCollector(envs, model, buffer, torch.device("cpu"), env_seeds(cfg.seed, 0, 0, n))
    clock = LayerClock(collector.policy.model)
    frames = torch.from_numpy(np.ascontiguousarray(collector.next_obs))
    block = np.ones(8 << 20, dtype=np.uint8)
    gaps = {"back to back": lambda: None, "after spin": lambda: spin(GAP_S),
            "after read": block.sum, "after sleep": lambda: time.sleep(GAP_S)}
    times: dict[str, list[np.ndarray]] = {c: [] for c in CONDITIONS}
    collector.collect()  # warm-up, not counted
    clock.take()
    with torch.no_grad():
        for index in range(args.rounds):
            for condition in CONDITIONS[index % len(CONDITIONS):] + CONDITIONS[:index % len(CONDITIONS)]:
                if condition == "in rollout":
                    collector.collect()
                else:
                    for step in range(buffer.num_steps):
                        gaps[condition]()
                        slot = buffer.obs[step]
                        slot.copy_(frames)
                        collector.policy.sample(collector.policy(slot)[0])
                per_pass = clock.take()
                times[condition].append(per_pass[args.skip:])
    columns = ["input + " + clock.layers[0]] + clock.layers[1:] + ["outputs to fp32"]
    table = {}
    for condition in CONDITIONS:
        passes = np.concatenate(times[condition])
        table[condition] = {"forward_ms": float(np.median(passes.sum(axis=1)) * 1e3),
                            "layers_ms": {c: float(v) for c, v in zip(columns, np.median(passes, axis=0) * 1e3)},
                            "passes": int(len(passes))}
    envs.close()
    arguments = [repo_relative(a) if os.path.isabs(a) else a for a in sys.argv[1:]]
    return {"command": "python benchmarks/interleave.py " + " ".join(arguments),
            "config": args.config, "overrides": args.overrides, "cpu": cpu, "rounds": args.rounds,
            "gap_ms": GAP_S * 1e3, "precision": model.precision.mode, "batch": n, "conditions": table,
            "machine": {"cpus": os.cpu_count(), "processor": platform.machine(),
                        "torch": torch.__version__}}


def print_table(result: dict) -> None:
    table = result["conditions"]
    base = table["back to back"]["forward_ms"]
    print(f"forward pass of {result['batch']} observations ({result['precision']}), one thread on "
          f"CPU {result['cpu']}, medians over {result['rounds']} rounds, gap {result['gap_ms']:g} ms")
    columns = list(table["back to back"]["layers_ms"])
    width = max(len(c) for c in columns)
    print(f"{'':{width}} " + " ".join(f"{c:>13}" for c in CONDITIONS))
    for column in columns:
        print(f"{column:{width}} " + " ".join(f"{table[c]['layers_ms'][column]:13.3f}" for c in CONDITIONS))
    print(f"{'forward (ms)':{width}} " + " ".join(f"{table[c]['forward_ms']:13.3f}" for c in CONDITIONS))
    print(f"{'vs back to back':{width}} " + " ".join(f"{table[c]['forward_ms'] / base:13.2f}" for c in CONDITIONS))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/atari_ppo.toml")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip", type=int, default=10, help="first forward passes of each block not counted")
    parser.add_argument("--cpu", type=int, help="CPU to pin to (default: the last one allowed)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    os.chdir(REPO)
    args.config = repo_relative(args.config)
    result = measure(args)
    print_table(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
