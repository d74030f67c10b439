"""Calibrating the liveness estimate with a measured batch, and doing it for a model at load.

`calibrate` measures one batch (measure.py) and sets the estimator's factor, measured /
estimated, when the measurement can be trusted; `calibrate_model` does it for each sequence
bucket of a model ([memory] calibrate_at_warmup). Why a factor is needed at all, and why it
depends on the sequence length: docs/memory-measurement.md, "Calibration". Blocking.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..config import ModelConfig
from .device import DeviceProfile
from .measure import (
    RESOLUTION_BYTES,
    ActivationMeasurement,
    KiB,
    MiB,
    measure_activation_peak,
)

if TYPE_CHECKING:
    from .estimator import OnnxFootprintEstimator

log = logging.getLogger(__name__)

# calibrate() only trusts measurements whose run peak is at least this large (~25% noise).
MIN_CALIBRATION_BYTES = 4 * RESOLUTION_BYTES
# ... and only factors in this range; anything else means the measurement or the model is off.
CALIBRATION_BOUNDS = (0.25, 8.0)


@dataclass(frozen=True)
class Calibration:
    """The outcome of calibrate(): the factor now on the estimator and where it came from."""

    factor: float
    applied: bool
    reason: str
    batch: int
    seq_len: int | None
    raw_estimate: int
    measurement: ActivationMeasurement | None

    def to_json(self) -> dict[str, Any]:
        return {
            "factor": self.factor, "applied": self.applied, "reason": self.reason,
            "batch": self.batch, "seq_len": self.seq_len, "raw_estimate": self.raw_estimate,
            "measurement": self.measurement.to_json() if self.measurement else None,
        }


def calibration_factor(raw_estimate: int, measurement: ActivationMeasurement) -> tuple[float | None, str]:
    """(measured / estimated, why) when the measurement can be trusted, else (None, why not)."""
    return trusted_factor(raw_estimate, measurement.activation_peak, measurement.run_peak)


def trusted_factor(raw_estimate: int, activation_peak: int, run_peak: int) -> tuple[float | None, str]:
    if run_peak < MIN_CALIBRATION_BYTES:
        return None, (
            f"measured run peak {run_peak / MiB:.2f} MiB is below {MIN_CALIBRATION_BYTES / MiB:.0f} MiB, "
            f"too close to the {RESOLUTION_BYTES // KiB} KiB resolution to calibrate with"
        )
    if raw_estimate <= 0:
        return None, "the raw estimate is 0"
    factor = activation_peak / raw_estimate
    low, high = CALIBRATION_BOUNDS
    if not low <= factor <= high:
        return None, f"factor {factor:.2f} is outside {low}-{high}; check the model and the measurement"
    return factor, f"measured {activation_peak / MiB:.2f} MiB / estimated {raw_estimate / MiB:.2f} MiB"


def calibrate(
    estimator: OnnxFootprintEstimator,
    model: ModelConfig | str | os.PathLike[str],
    batch: int,
    seq_len: int | None = None,
    *,
    repeat: int = 1,
    measure: Callable[..., ActivationMeasurement] = measure_activation_peak,
    for_length: bool = False,
) -> Calibration:
    """Measure one batch (measure_activation_peak) and set the estimator's calibration to
    measured / raw liveness estimate, for a model's warm-up: the default factor, or with
    ``for_length`` the factor of this seq_len only (a length bucket).

    Use a size whose activations are a few MiB at least (the largest preferred size of the
    largest bucket is safest), and calibrate once per bucket if the buckets differ much (the
    factor depends on the sequence length). When the measurement is too small or the factor
    implausible the estimator keeps its calibration and applied is False.
    """
    target = seq_len if for_length else None
    raw = estimator.activation_peak(batch, seq_len)
    measurement = measure(model, batch, seq_len, repeat=repeat)
    factor, reason = calibration_factor(raw, measurement)
    if factor is None:
        return Calibration(estimator.calibration_for(target), False, reason, batch, seq_len, raw, measurement)
    estimator.set_calibration(factor, target)
    return Calibration(factor, True, reason, batch, seq_len, raw, measurement)


def calibrate_model(config: ModelConfig, estimator: OnnxFootprintEstimator) -> None:
    """Scale the liveness estimate to measured batches at the largest preferred size: at the
    largest bucket for the default factor (its activations are the easiest to measure), then
    at each shorter bucket for a factor of its own, since ONNX Runtime's excess over liveness
    grows with the length. A bucket too small to measure keeps the default, which is then
    on the safe side. One measurement (a subprocess with its own copy of the weights) each."""
    size = config.batching.preferred_batch_sizes[-1]
    buckets = config.sequence.buckets if config.sequence else [None]
    for i, seq_len in enumerate(reversed(buckets)):
        result = calibrate(estimator, config, size, seq_len, for_length=i > 0)
        log.info("model %s: activation estimate calibration %.2f%s (%s)", config.name, result.factor,
                 "" if i == 0 else f" at length {seq_len}",
                 "measured" if result.applied else f"not applied: {result.reason}")
        if i == 0 and not result.applied:
            break  # the longest bucket could not be measured: the shorter ones cannot either


def calibrate_on_device(config: ModelConfig, estimator: OnnxFootprintEstimator, device: DeviceProfile) -> None:
    """Scale the liveness estimate to what the device measured at load, for sizes that were not
    measured (measured sizes cost what they cost). Per bucket: what the arena grew by from the
    smallest size to the largest, over the raw estimate's difference, which leaves out what only
    the first run pays; the largest factor becomes the default (the safe side)."""
    buckets = config.sequence.buckets if config.sequence else [0]
    factors = []
    for bucket in buckets:
        found = device.growth_above_smallest(bucket)
        if found is None:
            continue
        small, large, grown = found
        raw = estimator.activation_peak(large, bucket or None) - estimator.activation_peak(small, bucket or None)
        factor, reason = trusted_factor(raw, grown, grown)
        log.info("model %s: activation estimate %s on the device%s (%s, batch %d to %d)", config.name,
                 f"calibrated {factor:.2f}" if factor is not None else "not calibrated",
                 f" at length {bucket}" if bucket else "", reason, small, large)
        if factor is not None:
            factors.append(factor)
            if bucket:
                estimator.set_calibration(factor, bucket)
    if factors:
        estimator.set_calibration(max(factors))
