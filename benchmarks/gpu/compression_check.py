"""Compression state on the device (issue 33 findings 1-2), after the stopped-and-resumed
compressed runs of run_on_device.sh: each rank's saved residuals and Q (CPU tensors in its
checkpoints/ranks/rank<r>.pt) load onto the device, save back as CPU tensors, and the top-k sum
of the ranks' sparse parts repeats bit for bit on the device under
torch.use_deterministic_algorithms, where CUDA's atomic index_add_ need not (measured, reported).

    python benchmarks/gpu/compression_check.py --device cuda --runs RUNS --out compression.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def state_round_trip(run_dir: Path, device: str) -> dict:
    import torch

    from hvd_rl.runtime.compression import PowerSGD, TopK

    files = sorted((run_dir / "checkpoints" / "ranks").glob("rank*.pt"))
    out = {"run": run_dir.name, "files": len(files), "on_device": True, "saved_on_cpu": True}
    for path in files:
        saved = torch.load(path, map_location="cpu", weights_only=True)["compression"][0]
        tensors = {**saved.get("residuals", {}), **saved.get("q", {})}
        biggest = max(int(i) for i in tensors) + 1
        params = [torch.nn.Parameter(torch.zeros(1, device=device)) for _ in range(biggest)]
        compressor = PowerSGD(params, rank=4) if "q" in saved else TopK(params, ratio=0.01)
        compressor.load_state_dict(saved)
        held = list(compressor.residuals.values()) + list(getattr(compressor, "q", {}).values())
        out["on_device"] &= all(t.device.type == torch.device(device).type for t in held)
        again = compressor.state_dict()
        out["saved_on_cpu"] &= all(t.device.type == "cpu" for part in again.values() for t in part.values())
    return out


def topk_sum_repeats(device: str, ranks: int = 16, size: int = 1_700_000, kept: int = 17_000, repeats: int = 20) -> dict:
    import torch

    from hvd_rl.runtime.compression import _sum_sparse_by_rank

    g = torch.Generator().manual_seed(0)
    indices = torch.stack([torch.randint(0, size, (kept,), generator=g).unique()[:kept // 2] for _ in range(ranks)])
    values = torch.randn(indices.shape, generator=g).to(device)
    indices = indices.to(device)
    like = torch.zeros(size, device=device)
    torch.use_deterministic_algorithms(True)
    try:
        ours = [_sum_sparse_by_rank(like, indices, values) for _ in range(repeats)]
    finally:
        torch.use_deterministic_algorithms(False)
    atomic = [torch.zeros(size, device=device).index_add_(0, indices.reshape(-1), values.reshape(-1))
              for _ in range(repeats)]
    return {"device": device, "repeats": repeats,
            "fixed_order_bitwise_repeatable": all(torch.equal(ours[0], x) for x in ours),
            "index_add_bitwise_repeatable": all(torch.equal(atomic[0], x) for x in atomic)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--runs", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    runs = Path(args.runs)
    result = {"state": [state_round_trip(d, args.device) for d in sorted(runs.glob("c_*_resumed")) if d.is_dir()],
              "topk_sum": topk_sum_repeats(args.device)}
    result["ok"] = (bool(result["state"]) and all(s["files"] == 2 and s["on_device"] and s["saved_on_cpu"]
                                                  for s in result["state"])
                    and result["topk_sum"]["fixed_order_bitwise_repeatable"])
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
