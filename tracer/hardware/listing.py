"""What `llmtrace hardware --json` prints: every profile with its ridge points, and where measured ones are saved.
Pure Python (no torch); `--measure --json` adds the measurement (tracer/hardware/measure.py, MeasureReport)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from llmtrace.tracer.hardware.profiles import PEAK_DTYPES, HardwareProfile

HARDWARE_SCHEMA = "llmtrace.hardware/1"  # tracer/hardware/hardware_schema.json


@dataclass(frozen=True, slots=True)
class ProfileRow(HardwareProfile):
    """A profile's fields, then its ridge points."""

    ridge_point: dict[str, float] = field(default_factory=dict)  # FLOPs per byte, for each dtype with a peak

    @classmethod
    def of(cls, profile: HardwareProfile) -> "ProfileRow":
        return cls(**asdict(profile),
                   ridge_point={d: profile.ridge_point(d) for d in PEAK_DTYPES if profile.has_peak(d)})


@dataclass(frozen=True, slots=True)
class HardwareListing:
    schema: str  # HARDWARE_SCHEMA
    profiles: tuple[ProfileRow, ...]  # the datasheet profiles in table order, then the measured ones
    store: str  # the file measured profiles are saved in (tracer/hardware/store.py)


def hardware_listing(profiles: list[HardwareProfile], store: str) -> HardwareListing:
    return HardwareListing(HARDWARE_SCHEMA, tuple(ProfileRow.of(p) for p in profiles), store)
