"""Worker: each rank contributes (rank + 1) * [1, 2, 3]; prints the allreduced sum as JSON."""
import json
import sys

import torch

import horovod.torch as hvd

hvd.init()
total = hvd.allreduce(torch.tensor([1.0, 2.0, 3.0]) * (hvd.rank() + 1), op=hvd.Sum, name="check")
sys.stdout.write(json.dumps({"rank": hvd.rank(), "size": hvd.size(), "sum": total.tolist(),
                  "mpi": hvd.mpi_enabled(), "gloo": hvd.gloo_enabled()}) + "\n")
sys.stdout.flush()
