"""Throughput arithmetic: FLOPs per token, peak FLOP/s of known accelerators, MFU.

Pure functions (no torch): the trainer measures time and tokens, this module turns them into
model FLOP utilisation (MFU), the number that says how well a layout uses the hardware whatever
the model size. MFU counts *model* FLOPs (what the math needs), not hardware FLOPs, so activation
recomputation does not inflate it (PaLM appendix B).
"""

from __future__ import annotations

from etrain.workers.families import family
from etrain.workers.protocol.run_config import ModelConfig

__all__ = ["PEAK_FLOPS", "flops_per_token", "mfu", "peak_flops_per_s", "tokens_per_s"]

# Dense peak FLOP/s per device (no 2:4 sparsity), from the vendors' data sheets (SXM parts unless
# named). fp32 means plain fp32 (not TF32) on the CUDA cores.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp32": 67e12},  # SXM; the PCIe part is matched below
    "H100 PCIe": {"bf16": 756e12, "fp32": 51e12},
    "A100": {"bf16": 312e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp32": 91.6e12},
    "L4": {"bf16": 121e12, "fp32": 30.3e12},
    "A10G": {"bf16": 70e12, "fp32": 31.2e12},  # AWS g5 (A10G): 70 TFLOPs dense bf16 tensor
    "A10": {"bf16": 125e12, "fp32": 31.2e12},
    "V100": {"bf16": 125e12, "fp32": 15.7e12},  # no bf16 tensor cores: fp16 figure
    "T4": {"bf16": 65e12, "fp32": 8.1e12},  # fp16 figure
}


def flops_per_token(model: ModelConfig) -> float:
    """Training FLOPs per token of ``model``: its family's one formula
    (``etrain.workers.families.base.ModelFamily.flops_per_token``), which the planner uses too."""
    return family(model.arch).flops_per_token(model)


def peak_flops_per_s(device_name: str | None, precision: str) -> float | None:
    """Peak dense FLOP/s of one device named like ``torch.cuda.get_device_name()``; None if unknown.

    Longest table key first, so "H100 PCIe" wins over "H100" and "A100" over "A10".
    """
    if not device_name:
        return None
    name = device_name.upper()
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):
        if key.upper() in name:
            return PEAK_FLOPS[key]["bf16" if precision == "bf16" else "fp32"]
    return None


def tokens_per_s(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def mfu(flops_per_s: float, num_devices: int, peak_per_device: float | None) -> float | None:
    """Achieved / peak FLOP/s over all devices of the job; None when the peak is unknown (CPU)."""
    if peak_per_device is None or num_devices < 1:
        return None
    return flops_per_s / (peak_per_device * num_devices)
