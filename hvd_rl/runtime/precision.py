"""Mixed precision: one autocast policy for rollout inference and the learner alike.

Both must run the network at the same precision. If the rollout's log-probabilities came from an
fp32 forward pass and the learner's from a bf16 one, the PPO ratio of the very first minibatch
would already differ from 1 by the rounding error and clipping would act on noise.

`distributed.amp`:
  off   fp32 everywhere (bit-exact N-rank == 1-process updates)
  bf16  torch.autocast to bfloat16, on CPU (oneDNN) or CUDA
  fp16  torch.autocast to float16 with a GradScaler, CUDA only
  auto  bf16 for convolutional models where the hardware does bf16 natively (CPUs with
        AVX512-BF16/AMX, CUDA devices with bf16 support), fp32 otherwise. Measured on this
        project's 2-core AMD EPYC (avx512_bf16): the Nature CNN trains 1.9x faster in bf16; a
        64x64 MLP gains nothing (autocast overhead dominates), so MLPs stay fp32.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import ContextManager

import torch

AMP_MODES = ("off", "auto", "bf16", "fp16")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class PrecisionError(ValueError):
    """The requested precision cannot run on this device."""


CPU_BF16_VAR = "HVD_RL_CPU_BF16"  # 1/0: overrides the detection (containers hiding CPU flags; tests)


def cpu_has_native_bf16() -> bool:
    """True when this CPU computes bf16 matrix products in hardware (AVX512-BF16 or AMX)."""
    if os.environ.get(CPU_BF16_VAR) in ("0", "1"):
        return os.environ[CPU_BF16_VAR] == "1"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("avx512_bf16", "amx_bf16"))


def resolve_amp(amp: str, device: torch.device, convolutional: bool) -> str:
    """The precision actually used: 'off', 'bf16' or 'fp16'. Raises PrecisionError if impossible."""
    if amp == "auto":
        if not convolutional:
            return "off"
        if device.type == "cuda":
            return "bf16" if torch.cuda.is_bf16_supported() else "off"
        return "bf16" if cpu_has_native_bf16() else "off"
    if amp == "fp16" and device.type != "cuda":
        raise PrecisionError("distributed.amp = 'fp16' needs a CUDA device (loss scaling on GPUs); "
                             "use 'bf16' or 'auto' on CPUs")
    if amp == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise PrecisionError("distributed.amp = 'bf16' but this GPU has no bf16 support; use 'fp16'")
    return amp


@dataclass(frozen=True)
class Precision:
    """What the rollout and the learner both enter around every forward pass."""

    mode: str  # off | bf16 | fp16 (resolved, never 'auto')
    device_type: str  # cpu | cuda

    @property
    def dtype(self) -> torch.dtype | None:
        return _DTYPES.get(self.mode)

    def autocast(self) -> ContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def adam(self, parameters, lr: float, eps: float) -> torch.optim.Adam:
        """Adam with the fused kernel where the precision is inexact anyway (bf16, fp16): measured
        for the Nature CNN on one core, 1 ms per step against 4-9 ms for the for-loop kernel (an
        Atari PPO iteration takes 16 steps, a DQN update is ~10 ms). fp32 keeps the for-loop kernel:
        with it N ranks reproduce 1 process to float rounding (2e-6 after 24 steps), while the
        fused kernel amplifies the ranks' different summation order (2e-3 on the same test)."""
        return torch.optim.Adam(parameters, lr=lr, eps=eps, fused=self.adam_fused)

    @property
    def adam_fused(self) -> bool | None:
        return True if self.dtype is not None else None

    def keep_adam_kernel(self, optimizer: torch.optim.Optimizer) -> None:
        """After loading an optimizer's state (a checkpoint from a run in another precision, an
        elastic restore): its param groups came with that run's kernel choice; this run's stays."""
        for group in optimizer.param_groups:
            group["fused"] = self.adam_fused

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none."""
        return torch.amp.GradScaler("cuda") if self.mode == "fp16" else None


def precision_for(amp: str, device: torch.device, convolutional: bool) -> Precision:
    return Precision(resolve_amp(amp, device, convolutional), device.type)
