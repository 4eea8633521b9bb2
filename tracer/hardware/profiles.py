"""Hardware profiles: the two ceilings of a roofline (peak FLOP/s per dtype, memory bandwidth) plus memory capacity
and the interconnect tensor parallelism runs over. Pure Python; no torch.

Every figure is the vendor's DENSE number (datasheets print the 2:4-sparsity figure with an asterisk; that is twice
the dense one and no LLM inference kernel uses it). Units: FLOP/s and bytes/s as plain floats; bandwidths are
decimal (TB/s = 1e12 bytes/s, as datasheets print them); capacities are binary (an "80GB" HBM part is 80 GiB:
five 16 GiB stacks).

The measured profile `this-machine` is not in this table: `llmtrace hardware --measure` writes it to the user's
config folder (tracer/hardware/store.py) and `get_profile` reads it from there.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from llmtrace.tracer.core.dtypes import BF16, FP8, FP16, FP32, INT8, TF32, DType
from llmtrace.tracer.core.errors import HardwareError

GiB = 2**30
TERA = 1e12
GIGA = 1e9

# The dtypes a profile can give a peak for, in display order; their names are the profile's peak fields, which
# peak(), has_peak() and ridge_point() look up. "tf32" is a tensor-core mode for fp32 matmuls (PyTorch leaves it off
# by default: torch.backends.cuda.matmul.allow_tf32 = False).
PEAK_DTYPES: tuple[str, ...] = tuple(d.name for d in (FP32, TF32, BF16, FP16, FP8, INT8))

THIS_MACHINE = "this-machine"

# HardwareProfile.inference_ridge's dtypes, in order of preference.
RIDGE_DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp32")

# GEMM dtypes `llmtrace hardware --measure` can time with torch (tf32 on CUDA only).
MEASURABLE_DTYPES: tuple[DType, ...] = (FP32, TF32, BF16, FP16)


@dataclass(frozen=True, slots=True)
class HardwareProfile:
    """One accelerator (or this machine): its ceilings, memory and interconnect."""

    name: str  # lookup key, e.g. "a100-80gb"
    label: str  # display name, e.g. "NVIDIA A100 80GB SXM"
    memory_bandwidth: float  # bytes/s
    memory_bytes: int  # capacity usable by weights + KV cache + activations
    fp32: float | None  # dense FLOP/s per dtype; None = no hardware path for that dtype
    tf32: float | None
    bf16: float | None
    fp16: float | None
    fp8: float | None
    int8: float | None  # OP/s (one multiply-add = 2 OPs, like FLOPs)
    interconnect: str  # "NVLink 3", "PCIe 4.0" (x16), "xGMI", "none"
    # Per device, both directions together, as datasheets print it (A100: "NVLink 600GB/s"); 0 when none.
    interconnect_bandwidth: float
    source: str  # datasheet, or how it was measured
    measured: bool = False

    def peak(self, dtype: str) -> float:
        """Peak dense FLOP/s for `dtype`; HardwareError when this hardware has none for it."""
        if dtype not in PEAK_DTYPES:
            raise HardwareError(f"no peak FLOP/s kind {dtype!r}; kinds are {', '.join(PEAK_DTYPES)}")
        value = getattr(self, dtype)
        if value is None:
            have = ", ".join(d for d in PEAK_DTYPES if getattr(self, d) is not None)
            hint = (
                f"run `llmtrace hardware --measure --dtypes {dtype}`"
                if self.measured
                else f"choose a dtype it has ({have})"
            )
            raise HardwareError(f"{self.name} has no {dtype} peak FLOP/s ({have} only); {hint}")
        return value

    def has_peak(self, dtype: str) -> bool:
        return dtype in PEAK_DTYPES and getattr(self, dtype) is not None

    def inference_ridge(self) -> tuple[str, float] | None:
        """The ridge point of the 16-bit peak LLM inference usually runs in (bf16, else fp16, else fp32), with the
        dtype it comes from; None for a profile with none of those peaks."""
        for dtype in RIDGE_DTYPES:
            if self.has_peak(dtype):
                return dtype, self.ridge_point(dtype)
        return None

    def ridge_point(self, dtype: str) -> float:
        """FLOPs per byte at which the compute ceiling meets the memory ceiling: peak FLOP/s / bandwidth."""
        return self.peak(dtype) / self.memory_bandwidth

    @property
    def link_bandwidth_one_way(self) -> float:
        """Bytes/s one device can send (and, at the same time, receive): half the bidirectional datasheet figure.

        A ring all-reduce is limited by this (it is nccl-tests' peak "bus bandwidth")."""
        return self.interconnect_bandwidth / 2


def _tf(x: float) -> float:
    return x * TERA


# ---- datasheet profiles -------------------------------------------------------------------------------------------

_PROFILE_LIST: tuple[HardwareProfile, ...] = (
    # NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/
    # nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), SXM column: FP32 19.5 TF, TF32 156 (312*), BF16/FP16 312
    # (624*), INT8 624 TOPS (1248*); "A100 80GB" HBM2e 2,039 GB/s; NVLink 600 GB/s. No FP8.
    HardwareProfile("a100-80gb", "NVIDIA A100 80GB SXM", 2039 * GIGA, 80 * GiB,
                    fp32=_tf(19.5), tf32=_tf(156), bf16=_tf(312), fp16=_tf(312), fp8=None, int8=_tf(624),
                    interconnect="NVLink 3", interconnect_bandwidth=600 * GIGA,
                    source="NVIDIA A100 datasheet (SXM, dense)"),
    # Same datasheet, "A100 40GB" SXM: HBM2 1,555 GB/s; compute identical.
    HardwareProfile("a100-40gb", "NVIDIA A100 40GB SXM", 1555 * GIGA, 40 * GiB,
                    fp32=_tf(19.5), tf32=_tf(156), bf16=_tf(312), fp16=_tf(312), fp8=None, int8=_tf(624),
                    interconnect="NVLink 3", interconnect_bandwidth=600 * GIGA,
                    source="NVIDIA A100 datasheet (SXM, dense)"),
    # NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100/), H100 SXM column: FP32 67 TF,
    # TF32 989*, BF16/FP16 1,979*, FP8 3,958*, INT8 3,958* TOPS (* = with sparsity: dense is half);
    # 80 GB HBM3 3.35 TB/s; NVLink 900 GB/s.
    HardwareProfile("h100-sxm", "NVIDIA H100 80GB SXM", 3350 * GIGA, 80 * GiB,
                    fp32=_tf(67), tf32=_tf(494.5), bf16=_tf(989.5), fp16=_tf(989.5), fp8=_tf(1979),
                    int8=_tf(1979), interconnect="NVLink 4", interconnect_bandwidth=900 * GIGA,
                    source="NVIDIA H100 datasheet (SXM, dense = half the sparsity figure)"),
    # Same datasheet, H100 PCIe column: FP32 51 TF, TF32 756*, BF16/FP16 1,513*, FP8 3,026*, INT8 3,026* TOPS;
    # 80 GB HBM2e 2 TB/s; PCIe Gen5 128 GB/s (an NVLink bridge joins only pairs of cards, so TP over more than two
    # cards runs over PCIe).
    HardwareProfile("h100-pcie", "NVIDIA H100 80GB PCIe", 2000 * GIGA, 80 * GiB,
                    fp32=_tf(51), tf32=_tf(378), bf16=_tf(756.5), fp16=_tf(756.5), fp8=_tf(1513),
                    int8=_tf(1513), interconnect="PCIe 5.0", interconnect_bandwidth=128 * GIGA,
                    source="NVIDIA H100 datasheet (PCIe, dense = half the sparsity figure)"),
    # NVIDIA H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200/), H200 SXM column: FP32 67 TF,
    # TF32 989*, BF16/FP16 1,979*, FP8 3,958*, INT8 3,958*; 141 GB HBM3e 4.8 TB/s; NVLink 900 GB/s.
    # (141 of the six 24 GiB stacks' 144 GiB are enabled; taken as 141 GiB.)
    HardwareProfile("h200", "NVIDIA H200 141GB SXM", 4800 * GIGA, 141 * GiB,
                    fp32=_tf(67), tf32=_tf(494.5), bf16=_tf(989.5), fp16=_tf(989.5), fp8=_tf(1979),
                    int8=_tf(1979), interconnect="NVLink 4", interconnect_bandwidth=900 * GIGA,
                    source="NVIDIA H200 datasheet (SXM, dense = half the sparsity figure)"),
    # NVIDIA L4 Tensor Core GPU datasheet: FP32 30.3 TF, TF32 120*, BF16/FP16 242*, FP8 485*, INT8 485* TOPS;
    # 24 GB GDDR6 300 GB/s; PCIe Gen4 x16 64 GB/s.
    HardwareProfile("l4", "NVIDIA L4", 300 * GIGA, 24 * GiB,
                    fp32=_tf(30.3), tf32=_tf(60), bf16=_tf(121), fp16=_tf(121), fp8=_tf(242.5), int8=_tf(242.5),
                    interconnect="PCIe 4.0", interconnect_bandwidth=64 * GIGA,
                    source="NVIDIA L4 datasheet (dense = half the sparsity figure)"),
    # NVIDIA L40S datasheet: FP32 91.6 TF, TF32 183 (366*), BF16/FP16 362.05 (733*), FP8 733 (1,466*),
    # INT8 733 (1,466*) TOPS; 48 GB GDDR6 864 GB/s; PCIe Gen4 x16 64 GB/s bidirectional, no NVLink.
    HardwareProfile("l40s", "NVIDIA L40S", 864 * GIGA, 48 * GiB,
                    fp32=_tf(91.6), tf32=_tf(183), bf16=_tf(362.05), fp16=_tf(362.05), fp8=_tf(733), int8=_tf(733),
                    interconnect="PCIe 4.0", interconnect_bandwidth=64 * GIGA,
                    source="NVIDIA L40S datasheet (dense)"),
    # NVIDIA Ampere GA102 GPU architecture whitepaper, appendix table for GeForce RTX 3090: FP32 35.6 TF,
    # TF32 35.6, BF16 71 (FP32 accumulate), FP16 71 with FP32 accumulate (142 with FP16 accumulate; PyTorch
    # accumulates fp16 GEMMs in fp32, so 71 is the ceiling it sees), INT8 284 TOPS; 24 GB GDDR6X 936 GB/s.
    # Interconnect: PCIe 4.0 x16 (its NVLink bridge, 112.5 GB/s, joins only a pair of cards).
    HardwareProfile("rtx-3090", "NVIDIA GeForce RTX 3090", 936 * GIGA, 24 * GiB,
                    fp32=_tf(35.6), tf32=_tf(35.6), bf16=_tf(71), fp16=_tf(71), fp8=None, int8=_tf(284),
                    interconnect="PCIe 4.0", interconnect_bandwidth=64 * GIGA,
                    source="NVIDIA GA102 whitepaper (dense, FP32 accumulate)"),
    # NVIDIA Ada Lovelace architecture whitepaper, appendix table for GeForce RTX 4090: FP32 82.6 TF, TF32 82.6,
    # BF16 165.2 and FP16 165.2 (FP32 accumulate; 330.3 with FP16 accumulate), FP8 330.3 (FP32 accumulate),
    # INT8 660.6 TOPS; 24 GB GDDR6X 1,008 GB/s; PCIe 4.0 x16, no NVLink.
    HardwareProfile("rtx-4090", "NVIDIA GeForce RTX 4090", 1008 * GIGA, 24 * GiB,
                    fp32=_tf(82.6), tf32=_tf(82.6), bf16=_tf(165.2), fp16=_tf(165.2), fp8=_tf(330.3),
                    int8=_tf(660.6), interconnect="PCIe 4.0", interconnect_bandwidth=64 * GIGA,
                    source="NVIDIA Ada whitepaper (dense, FP32 accumulate)"),
    # AMD Instinct MI300X data sheet (amd.com/.../instinct-mi300x-data-sheet.pdf): FP32 matrix 163.4 TF,
    # TF32 653.7, BF16/FP16 1,307.4, FP8 2,614.9, INT8 2,614.9 TOPS (sparsity doubles these);
    # 192 GB HBM3 5.3 TB/s; Infinity Fabric (xGMI): 7 links, 896 GB/s aggregate peak per GPU (8-GPU full mesh).
    HardwareProfile("mi300x", "AMD Instinct MI300X", 5300 * GIGA, 192 * GiB,
                    fp32=_tf(163.4), tf32=_tf(653.7), bf16=_tf(1307.4), fp16=_tf(1307.4), fp8=_tf(2614.9),
                    int8=_tf(2614.9), interconnect="xGMI", interconnect_bandwidth=896 * GIGA,
                    source="AMD MI300X data sheet (dense)"),
    # Apple M2 Max (apple.com/newsroom, Jan 2023; MacBook Pro tech specs): 38-core GPU, 400 GB/s unified memory,
    # up to 96 GB. Apple publishes no FLOP/s: 38 cores x 128 FP32 ALUs x 2 FLOPs x 1.398 GHz = 13.6 TF, and its GPU
    # runs FP16 (and bf16 via Metal, taken at the same rate) at the FP32 rate. No fp8/int8 GEMM path on the GPU.
    HardwareProfile("m2-max", "Apple M2 Max (38-core GPU, 96 GB)", 400 * GIGA, 96 * GiB,
                    fp32=_tf(13.6), tf32=None, bf16=_tf(13.6), fp16=_tf(13.6), fp8=None, int8=None,
                    interconnect="none", interconnect_bandwidth=0.0,
                    source="Apple specs (bandwidth, memory); FLOP/s derived from core count and clock"),
    # Apple M3 Max (apple.com/newsroom, Oct 2023; MacBook Pro tech specs): 40-core GPU with the 16-core CPU,
    # 400 GB/s unified memory, up to 128 GB. FLOP/s derived as above: 40 x 128 x 2 x 1.398 GHz = 14.3 TF.
    HardwareProfile("m3-max", "Apple M3 Max (40-core GPU, 128 GB)", 400 * GIGA, 128 * GiB,
                    fp32=_tf(14.3), tf32=None, bf16=_tf(14.3), fp16=_tf(14.3), fp8=None, int8=None,
                    interconnect="none", interconnect_bandwidth=0.0,
                    source="Apple specs (bandwidth, memory); FLOP/s derived from core count and clock"),
)

PROFILES: dict[str, HardwareProfile] = {p.name: p for p in _PROFILE_LIST}

# Short names people type.
ALIASES: dict[str, str] = {
    "a100": "a100-80gb",
    "a100-80g": "a100-80gb",
    "a100-40g": "a100-40gb",
    "h100": "h100-sxm",
    "h200-sxm": "h200",
    "3090": "rtx-3090",
    "4090": "rtx-4090",
    "rtx3090": "rtx-3090",
    "rtx4090": "rtx-4090",
    "m2max": "m2-max",
    "m3max": "m3-max",
}


def normalize_name(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def get_profile(name: str, measured: dict[str, HardwareProfile] | None = None) -> HardwareProfile:
    """The profile called `name` from the datasheet table or `measured` (this machine's saved profiles).

    Unknown names raise HardwareError naming the nearest profiles (and, for `this-machine`, how to create it)."""
    key = normalize_name(name)
    key = ALIASES.get(key, key)
    measured = measured or {}
    if key in measured:
        return measured[key]
    if key in PROFILES:
        return PROFILES[key]
    if key == THIS_MACHINE:
        raise HardwareError(
            "no profile 'this-machine' yet; run `llmtrace hardware --measure` once to measure this machine"
        )
    known = list(PROFILES) + list(measured) + [THIS_MACHINE]
    near = difflib.get_close_matches(key, known + list(ALIASES), n=3, cutoff=0.4)
    near = list(dict.fromkeys(ALIASES.get(n, n) for n in near))
    hint = f"did you mean {', '.join(near)}?" if near else "run `llmtrace hardware` to list them"
    raise HardwareError(f"unknown hardware {name!r}; {hint}")


def all_profiles(measured: dict[str, HardwareProfile] | None = None) -> list[HardwareProfile]:
    """Datasheet profiles in table order, then measured ones."""
    return list(PROFILES.values()) + list((measured or {}).values())
