"""``compress.state_dict()`` and its validation: the step counter of fixed bits, and the allocation and
estimates of ``bits="auto"``, as plain Python values a resumed run restores."""

from __future__ import annotations

import hashlib
import json
import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..config import CompressionConfig
from ..errors import InvalidArgumentError
from ..layout import QUANTIZABLE_DTYPES, STORED_AS_FLOAT32, SUPPORTED_BITS
from .allocation import MEASURED_BITS, NoiseProfile
from .report import AllocationReport, SlotEstimate, SlotKey

__all__ = ["STATE_FORMAT", "STATE_VERSION", "AutoState", "StateDictError", "auto_config", "auto_state_dict",
           "checksum", "fixed_state_dict", "load_fixed_state", "model_fingerprint", "parse_auto_state", "refuse"]

STATE_FORMAT = "daftrain.compress"
STATE_VERSION = 5

_FIXED_FIELDS = ("format", "version", "step", "config", "checksum")
_AUTO_FIELDS = ("format", "version", "step", "config", "model", "next_adapt", "reestimate", "estimated_at",
                "grad_variance", "calibration", "gradient_sq", "calibrated_for", "slots", "checksum")
_SLOT_FIELDS = ("index", "numel", "dtype", "shape", "itemsize", "op", "producer", "min_bits", "grad_sq",
                "plain_r2", "zero_r2", "plain_energy", "sensitivity", "bits")
_ITEMSIZE = {str(d).removeprefix("torch."): d.itemsize for d in (*QUANTIZABLE_DTYPES, *STORED_AS_FLOAT32)}
_MAX_INT = 2**63 - 1  # steps, positions and sizes are int64 everywhere else


class StateDictError(InvalidArgumentError):
    """A state dict that does not belong to this context (another model or config) or is corrupted."""


def model_fingerprint(model: nn.Module) -> str:
    """A short hash of the model's parameter names, shapes and dtypes."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad};".encode())
    return h.hexdigest()[:16]


def checksum(payload: Mapping[str, Any]) -> int:
    """CRC-32 of ``payload``'s canonical JSON."""
    return zlib.crc32(json.dumps(payload, sort_keys=True, allow_nan=True).encode())


def refuse(why: str) -> StateDictError:
    """The error for a state that cannot be loaded because of ``why``."""
    return StateDictError(f"cannot load this daftrain state dict: {why}; nothing was changed")


def _seal(payload: dict[str, Any]) -> dict[str, Any]:
    return {**payload, "checksum": checksum(payload)}


def _check_envelope(state: Mapping[str, Any], config: Mapping[str, Any], fields: tuple[str, ...]) -> None:
    """Format, version, checksum and config of a state dict, then its set of fields."""
    if not isinstance(state, Mapping):
        raise refuse(f"expected a mapping, got {type(state).__name__}")
    if state.get("format") != STATE_FORMAT or state.get("version") != STATE_VERSION:
        raise refuse(f"format {state.get('format')!r} version {state.get('version')!r} is not "
                     f"{STATE_FORMAT!r} version {STATE_VERSION}")
    payload = {k: v for k, v in state.items() if k != "checksum"}
    try:
        ok = state.get("checksum") == checksum(payload)
    except (TypeError, ValueError) as e:
        raise refuse(f"it is not serialisable ({e})") from None
    if not ok:
        raise refuse("its checksum does not match its contents (corrupted or edited)")
    if state.get("config") != config:
        raise refuse(f"it was saved with {state.get('config')}, this context has {dict(config)}")
    _check_fields("the state", state, fields)


def _check_fields(where: str, entry: Mapping[str, Any], fields: tuple[str, ...]) -> None:
    missing = [f for f in fields if f not in entry]
    unexpected = sorted(str(f) for f in entry if f not in fields)
    if missing:
        raise refuse(f"{where} lacks the fields {missing}")
    if unexpected:
        raise refuse(f"{where} has unexpected fields {unexpected}")


def _int(value: Any, name: str, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise refuse(f"{name} must be an int {bounds}, got {value!r}")
    return value


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise refuse(f"{name} must be a non-negative finite number, got {value!r}")
    return float(value)


def _bits(value: Any, name: str, allow_none: bool) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or value not in SUPPORTED_BITS:
        raise refuse(f"{name} must be one of {SUPPORTED_BITS}{' or None' if allow_none else ''}, got {value!r}")
    return value


# -- fixed bits ------------------------------------------------------------------------------------
def fixed_state_dict(config: CompressionConfig, step: int) -> dict[str, Any]:
    """The state of a context with fixed bits: its step counter (the rounding seeds follow it)."""
    return _seal({"format": STATE_FORMAT, "version": STATE_VERSION, "step": step,
                  "config": {"bits": config.bits, "group_size": config.group_size}})


def load_fixed_state(config: CompressionConfig, state: Mapping[str, Any]) -> int:
    """Validate a fixed-bits state; returns its step."""
    _check_envelope(state, {"bits": config.bits, "group_size": config.group_size}, _FIXED_FIELDS)
    return _int(state["step"], "step", -1, _MAX_INT)


# -- bits="auto" -----------------------------------------------------------------------------------
def auto_config(config: CompressionConfig, avg_bits: float | None) -> dict[str, Any]:
    """The part of an auto context's config its state must match (``avg_bits`` as resolved)."""
    return {"group_size": config.group_size, "avg_bits": avg_bits, "packed_bytes": config.packed_bytes,
            "error_share": config.error_share, "adapt_interval": config.adapt_interval}


def auto_state_dict(*, step: int, config: Mapping[str, Any], fingerprint: str | None, next_adapt: int,
                    reestimate: bool, report: AllocationReport | None, grad_variance: float | None,
                    calibration: Mapping[str, float], gradient_sq: float | None = None,
                    calibrated_for: int | None = None) -> dict[str, Any]:
    """The state of an auto context: the allocation in force with the estimates it follows from."""
    slots = []
    if report is not None:
        for a in report.slots:
            slots.append({
                "index": a.key.index, "numel": a.key.numel, "dtype": a.key.dtype, "shape": list(a.shape),
                "itemsize": a.itemsize, "op": a.op, "producer": a.producer, "min_bits": a.min_bits,
                "grad_sq": a.grad_sq, "plain_r2": a.noise.plain_r2, "zero_r2": a.noise.zero_r2,
                "plain_energy": list(a.noise.plain_measured),
                "sensitivity": a.sensitivity, "bits": a.bits,
            })
    return _seal({
        "format": STATE_FORMAT, "version": STATE_VERSION, "step": step, "config": dict(config),
        "model": fingerprint, "next_adapt": next_adapt, "reestimate": reestimate,
        "estimated_at": report.estimated_at_step if report is not None else None,
        "grad_variance": grad_variance, "calibration": dict(calibration), "gradient_sq": gradient_sq,
        "calibrated_for": calibrated_for, "slots": slots,
    })


@dataclass(frozen=True)
class AutoState:
    """A validated auto state: its slots' estimates with the bits saved for them, and the counters."""

    step: int
    next_adapt: int
    reestimate: bool
    estimated_at: int | None
    grad_variance: float | None
    calibration: dict[str, float]
    gradient_sq: float | None
    calibrated_for: int | None
    slots: tuple[tuple[SlotEstimate, int | None], ...]


# NOTE [ Whose state ]
# A state names its model by ``model_fingerprint`` (parameter names, shapes, dtypes), ``None`` when the
# context that saved it had no ``model=``. It loads only where the fingerprints are equal: a state of
# one model is refused by a context of another, and a state saved without a model only loads into a
# context without one (and the other way round), since the fingerprint of the side that has a model
# cannot be checked against nothing. Between two contexts without a model, the saved tensors tell the
# models apart once the loading context has allocated: its slots must be the state's.
def _check_model(saved: Any, fingerprint: str | None) -> None:
    if saved is not None and not isinstance(saved, str):
        raise refuse(f"model must be None or a fingerprint string, got {saved!r}")
    if saved == fingerprint:
        return
    if saved is None:
        raise refuse(f"it was saved by a context without model=, so nothing shows it belongs to this context's "
                     f"model (parameter fingerprint {fingerprint}); load it into a context created without "
                     "model=, or save it from a context created with model=")
    if fingerprint is None:
        raise refuse(f"it was saved for a model (parameter fingerprint {saved}) and this context has no model= "
                     "to tell whether it is another model; create the context with compress(model=...)")
    raise refuse(f"it belongs to another model (parameter fingerprint {saved}, this model {fingerprint})")


def parse_auto_state(state: Mapping[str, Any], *, config: Mapping[str, Any],
                     fingerprint: str | None) -> AutoState:
    """Validate every field of an auto state (see ``NOTE [ Whose state ]``); raises ``StateDictError``
    naming the first field that is wrong."""
    _check_envelope(state, config, _AUTO_FIELDS)
    _check_model(state["model"], fingerprint)
    step = _int(state["step"], "step", -1, _MAX_INT)
    next_adapt = _int(state["next_adapt"], "next_adapt", 0, step + config["adapt_interval"])
    if not isinstance(state["reestimate"], bool):
        raise refuse(f"reestimate must be a bool, got {state['reestimate']!r}")
    raw = state["slots"]
    if not isinstance(raw, list):
        raise refuse(f"slots must be a list, got {type(raw).__name__}")
    slots = tuple(_parse_slot(s, f"slots[{i}]") for i, s in enumerate(raw))
    if len({e.key.index for e, _ in slots}) != len(slots):
        raise refuse("two slots share one index")
    estimated_at = state["estimated_at"]
    if slots:
        estimated_at = _int(estimated_at, "estimated_at", 0, step)
    elif estimated_at is not None:
        raise refuse(f"estimated_at must be None when there are no slots, got {estimated_at!r}")
    variance = state["grad_variance"]
    if variance is not None:
        variance = _number(variance, "grad_variance")
    calibration = state["calibration"]
    if not isinstance(calibration, dict) or not all(
        isinstance(k, str) and isinstance(v, float) and math.isfinite(v) and v > 0 for k, v in calibration.items()
    ):
        raise refuse("calibration must map slot classes to positive finite floats")
    gradient_sq = state["gradient_sq"]
    if gradient_sq is not None:
        gradient_sq = _number(gradient_sq, "gradient_sq")
    calibrated_for = state["calibrated_for"]
    if calibrated_for is not None:
        calibrated_for = _int(calibrated_for, "calibrated_for", 0, step)
    return AutoState(step, next_adapt, state["reestimate"], estimated_at, variance, dict(calibration), gradient_sq,
                     calibrated_for, slots)


def _parse_slot(s: Any, name: str) -> tuple[SlotEstimate, int | None]:
    if not isinstance(s, Mapping):
        raise refuse(f"{name} must be a mapping, got {type(s).__name__}")
    _check_fields(name, s, _SLOT_FIELDS)
    index = _int(s["index"], f"{name}.index", 0, _MAX_INT)
    numel = _int(s["numel"], f"{name}.numel", 1, _MAX_INT)
    dtype = s["dtype"]
    if dtype not in _ITEMSIZE:
        raise refuse(f"{name}.dtype must be one of {sorted(_ITEMSIZE)}, got {dtype!r}")
    shape = s["shape"]
    if not isinstance(shape, list | tuple):
        raise refuse(f"{name}.shape must be a list of ints, got {shape!r}")
    dims = tuple(_int(d, f"{name}.shape[{j}]", 1) for j, d in enumerate(shape))
    if math.prod(dims) != numel:
        raise refuse(f"{name}.shape {list(dims)} does not hold {name}.numel = {numel} values")
    if s["itemsize"] != _ITEMSIZE[dtype] or isinstance(s["itemsize"], bool):
        raise refuse(f"{name}.itemsize must be {_ITEMSIZE[dtype]} for {dtype}, got {s['itemsize']!r}")
    for field in ("op", "producer"):
        if not isinstance(s[field], str):
            raise refuse(f"{name}.{field} must be a str, got {s[field]!r}")
    min_bits = _bits(s["min_bits"], f"{name}.min_bits", allow_none=False)
    bits = _bits(s["bits"], f"{name}.bits", allow_none=True)
    grad_sq = None if s["grad_sq"] is None else _number(s["grad_sq"], f"{name}.grad_sq")
    energy = s["plain_energy"]
    if not isinstance(energy, list | tuple) or len(energy) not in (0, len(MEASURED_BITS)):
        raise refuse(f"{name}.plain_energy must be a list of {len(MEASURED_BITS)} numbers (one per width of "
                     f"{MEASURED_BITS}) or empty, got {energy!r}")
    measured = tuple(_number(e, f"{name}.plain_energy[{j}]") for j, e in enumerate(energy))
    noise = NoiseProfile(_number(s["plain_r2"], f"{name}.plain_r2"), _number(s["zero_r2"], f"{name}.zero_r2"),
                         measured)
    sensitivity = _number(s["sensitivity"], f"{name}.sensitivity")
    assert min_bits is not None
    estimate = SlotEstimate(SlotKey(index, numel, dtype), dims, s["itemsize"], s["op"], s["producer"], grad_sq,
                            noise, sensitivity, min_bits)
    return estimate, bits
