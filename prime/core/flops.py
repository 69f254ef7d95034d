"""Peak FLOP/s of a device, for the MFU estimate."""

from __future__ import annotations

import time

import torch

# Dense bf16 tensor-core peaks (no sparsity), per device.
_KNOWN_GPUS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12, "4090": 165e12}


def peak_flops(device: torch.device, dtype: torch.dtype) -> float | None:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in _KNOWN_GPUS.items():
            if key in name:
                return value if dtype == torch.bfloat16 else value / 2
        return None
    return _measured_cpu_matmul_flops()


def _measured_cpu_matmul_flops(size: int = 512, seconds: float = 0.2) -> float:
    # CPUs have no published "peak" we can look up; a short fp32 matmul probe is the practical ceiling.
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        a @ b
        count += 1
    return 2 * size**3 * count / (time.perf_counter() - started)
