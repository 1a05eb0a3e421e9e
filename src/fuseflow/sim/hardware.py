"""Hardware specs as editable data: what one accelerator (or this CPU) can do.

Each entry holds datasheet peaks; how much of a peak real code reaches is a separate
`Efficiency` record, because efficiencies are what calibration fits while peaks stay
fixed facts. Add a device by adding one entry to `HARDWARE`, or load a JSON/YAML file
with the same fields through `load_hardware`.

Sources (dense, no sparsity; "per direction" for links):
- H100 SXM5 80GB: NVIDIA H100 datasheet: 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3,
  NVLink 4 at 900 GB/s bidirectional (450 GB/s per direction), one 400 Gb/s
  ConnectX-7 NIC per GPU in DGX H100 (50 GB/s).
- H200 SXM 141GB: NVIDIA H200 datasheet: same compute as H100, 4.8 TB/s HBM3e,
  141 GB, same NVLink and NIC as DGX H100.
- A100 SXM4 80GB: NVIDIA A100 datasheet: 312 TFLOP/s bf16, 2.039 TB/s HBM2e, NVLink 3
  at 600 GB/s bidirectional, one 200 Gb/s HDR NIC per GPU in DGX A100 (25 GB/s).
- L40S 48GB: NVIDIA L40S datasheet: 362 TFLOP/s bf16 dense, 864 GB/s GDDR6, no NVLink
  (PCIe Gen4 x16, 32 GB/s per direction); we assume one 100 Gb/s NIC per GPU.
- cpu: this 2-core x86 machine (AMD EPYC, AVX-512): 2 cores x 2.6 GHz x 64 fp32
  FLOP/cycle (two 512-bit FMA pipes) = 333 GFLOP/s; about 20 GB/s of memory bandwidth
  for a 2-core share of a server socket. Training on CPU runs in fp32 (4 bytes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import yaml


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak that real kernels reach, plus fixed latencies.

    Defaults for GPUs, with their rationale:
    - train_mfu 0.40: Megatron-LM reports 41-52% of peak for GPT models of 1B-1T on
      A100 (Narayanan et al., SC'21); RLHF trainers sit at the low end of that range.
    - infer_mfu 0.50: a forward pass (prefill, log-probs) has no backward or optimizer
      and runs large GEMMs; 50% of peak is typical of prefill in vLLM/SGLang reports.
    - decode_mbu 0.60: decode reaches about 60% of HBM bandwidth at useful batch
      sizes (Databricks "LLM inference performance engineering", 2023, MBU figures).
    - comm 0.75: NCCL all-reduce bus bandwidth reaches about 75% of link peak for
      large messages (nccl-tests on DGX systems).
    - layer_latency_s 10 us: per transformer layer per forward pass, the kernel
      launch and synchronisation floor (about ten kernels of ~1 us with CUDA graphs).
    - collective_latency_s 15 us: small-message NCCL all-reduce latency inside a node.
    - host_seconds_per_sample 0.2 ms: controller-side work per sample outside the
      devices (rule-based reward, advantage bookkeeping, batching); a few Python-level
      operations per sample.
    """

    train_mfu: float = 0.40
    infer_mfu: float = 0.50
    decode_mbu: float = 0.60
    comm: float = 0.75
    layer_latency_s: float = 10e-6
    collective_latency_s: float = 15e-6
    host_seconds_per_sample: float = 2e-4

    def __post_init__(self) -> None:
        for name in ("train_mfu", "infer_mfu", "decode_mbu", "comm"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"efficiency.{name}={value!r}: must be in (0, 1]")
        for name in ("layer_latency_s", "collective_latency_s", "host_seconds_per_sample"):
            if getattr(self, name) < 0:
                raise ValueError(f"efficiency.{name}={getattr(self, name)!r}: must be >= 0")


@dataclass(frozen=True)
class HardwareSpec:
    """Datasheet figures of one device; rates per device, bytes and bytes/s.

    `intra_bw` is the per-direction bandwidth to the other devices of the same node
    (NVLink or PCIe); `inter_bw` is the per-device network bandwidth between nodes.
    `param_bytes` is the dtype that training and inference run in on this device.
    `usable_memory_fraction` leaves room for the framework, CUDA context and
    fragmentation (vLLM's default gpu_memory_utilization is 0.9).
    """

    name: str
    peak_flops: float
    mem_bw: float
    mem_capacity: float
    intra_bw: float
    inter_bw: float
    gpus_per_node: int = 8
    param_bytes: int = 2
    usable_memory_fraction: float = 0.9
    efficiency: Efficiency = field(default_factory=Efficiency)

    def __post_init__(self) -> None:
        for f in ("peak_flops", "mem_bw", "mem_capacity", "intra_bw", "inter_bw"):
            if getattr(self, f) <= 0:
                raise ValueError(f"hardware {self.name}: {f}={getattr(self, f)!r} must be > 0")
        if self.gpus_per_node <= 0:
            raise ValueError(f"hardware {self.name}: gpus_per_node={self.gpus_per_node} must be > 0")

    @property
    def usable_memory(self) -> float:
        """Bytes of device memory that models may use: `mem_capacity * usable_memory_fraction`."""
        return self.mem_capacity * self.usable_memory_fraction

    def with_efficiency(self, **changes: float) -> HardwareSpec:
        """A copy with some efficiency factors replaced (used by calibration)."""
        return replace(self, efficiency=replace(self.efficiency, **changes))


GB = 1e9
TFLOPS = 1e12

# CPU: torch on a couple of cores is dominated by per-op dispatch (tens of microseconds
# per op, ~15 ops per layer), so its latency defaults are far above a GPU's.
_CPU_EFFICIENCY = Efficiency(
    train_mfu=0.3, infer_mfu=0.3, decode_mbu=0.5, comm=1.0,
    layer_latency_s=300e-6, collective_latency_s=0.0, host_seconds_per_sample=1e-3,
)  # fmt: skip

HARDWARE: dict[str, HardwareSpec] = {
    "H100": HardwareSpec("H100", 989 * TFLOPS, 3.35e12, 80 * GB, 450 * GB, 50 * GB),
    "H200": HardwareSpec("H200", 989 * TFLOPS, 4.8e12, 141 * GB, 450 * GB, 50 * GB),
    "A100": HardwareSpec("A100", 312 * TFLOPS, 2.039e12, 80 * GB, 300 * GB, 25 * GB),
    # No NVLink: collectives cross PCIe, whose small-message all-reduce latency is about
    # twice NVLink's (nccl-tests on PCIe servers report ~30 us).
    "L40S": HardwareSpec("L40S", 362 * TFLOPS, 864 * GB, 48 * GB, 32 * GB, 12.5 * GB,
                         efficiency=Efficiency(collective_latency_s=30e-6)),
    "cpu": HardwareSpec(
        "cpu", 333e9, 20 * GB, 16 * GB, 10 * GB, 10 * GB, gpus_per_node=1, param_bytes=4,
        usable_memory_fraction=0.8, efficiency=_CPU_EFFICIENCY,
    ),
}  # fmt: skip


def hardware_names() -> list[str]:
    """Names accepted by `get_hardware` (and `--gpu-type`)."""
    return sorted(HARDWARE)


def get_hardware(name: str) -> HardwareSpec:
    """Look a device up by name (case-insensitive), e.g. ``get_hardware("h100")``."""
    for key, spec in HARDWARE.items():
        if key.lower() == name.lower():
            return spec
    raise ValueError(f"gpu type {name!r}: unknown; choose one of: {', '.join(hardware_names())}")


def load_hardware(path: str | Path) -> HardwareSpec:
    """Read a HardwareSpec from a JSON or YAML file with the dataclass's field names.

    An optional ``efficiency`` mapping overrides the default efficiency factors.
    """
    path = Path(path)
    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"hardware file {path}: expected a mapping of HardwareSpec fields")
    allowed = {f.name for f in fields(HardwareSpec)}
    unknown = set(data) - allowed
    if unknown:
        raise ValueError(f"hardware file {path}: unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")
    eff = Efficiency(**data.pop("efficiency", {}))
    return HardwareSpec(**data, efficiency=eff)
