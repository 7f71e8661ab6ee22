"""`bin/preflight --rank-gpus PRICES`: the offered GPU types where the job fits, cheapest per hour first.

PRICES is `bin/pod gpus --json` (a file, or - for stdin): [{"id", "display_name", "memory_gb",
"price_per_hour"}]. No network here: the price list is read, never fetched (checks/ stays offline).
Each type is mapped to the catalog (checks/gpus.py) and the job is predicted on it with the same
estimate preflight prints; the hourly cost is the price per GPU times the job's world size.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from podkit.checks import gpus, memory
from podkit.checks.config import JobConfig
from podkit.checks.errors import ConfigError

GIB = 1 << 30
# RunPod's memoryInGb is the marketing size (80 for an 80 GB card), the catalog nvidia-smi's total
# in MiB (81559 for an H100): a 10% gap means the catalog entry is another card.
_MEMORY_TOLERANCE = 0.10


@dataclass(frozen=True)
class Offer:
    id: str
    memory_gb: int
    price_per_hour: float | None


@dataclass(frozen=True)
class Ranked:
    offer: Offer
    catalog: str | None
    """The catalog card the offer was predicted as; None when the catalog has no such card."""
    total_bytes: int = 0
    capacity_bytes: int = 0
    world_size: int = 1
    note: str = ""

    @property
    def fits(self) -> bool:
        return self.catalog is not None and self.total_bytes <= self.capacity_bytes

    @property
    def job_price_per_hour(self) -> float | None:
        p = self.offer.price_per_hour
        return None if p is None else round(p * self.world_size, 4)

    def to_json(self) -> dict:
        return {"id": self.offer.id, "catalog": self.catalog, "fits": self.fits, "gpus": self.world_size,
                "predicted_gib": round(self.total_bytes / GIB, 2), "capacity_gib": round(self.capacity_bytes / GIB, 2),
                "price_per_gpu_hour": self.offer.price_per_hour, "price_per_hour": self.job_price_per_hour,
                "note": self.note}


def load_offers(source: str) -> list[Offer]:
    fix = "pipe it from: bin/pod gpus --json | bin/preflight --rank-gpus -"
    if not source.strip():
        raise ConfigError("--rank-gpus", "is empty", "give the output of bin/pod gpus --json, or - for stdin")
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError("--rank-gpus", f"{source} is not UTF-8 text, so not a GPU price list", fix) from None
    except OSError as exc:
        raise ConfigError("--rank-gpus", f"cannot read {source}: {exc.strerror}", "give the output of bin/pod gpus --json, or -") from None
    try:
        rows = json.loads(text, parse_constant=_refuse_constant)
        if not isinstance(rows, list):
            raise ValueError(f"a JSON {type(rows).__name__}, not a list of GPU types")
        offers = [_offer(r) for r in rows]
    except (ValueError, RecursionError) as exc:
        what = str(exc) if not isinstance(exc, RecursionError) else "nested too deeply"
        raise ConfigError("--rank-gpus", f"{source} is not a GPU price list: {what}", fix) from None
    if not offers:
        raise ConfigError("--rank-gpus", f"{source} lists no GPU types", fix)
    for o in offers:
        # bin/pod gpus writes null for a type not for rent now, and memory 0 where RunPod gives none
        # (pods/runpod.py; such a type is skipped as not in the catalog); a negative or NaN price is no price.
        if o.memory_gb < 0 or (o.price_per_hour is not None and not (math.isfinite(o.price_per_hour)
                                                                    and o.price_per_hour >= 0)):
            raise ConfigError("--rank-gpus", f"{source}: {o.id} has memory_gb {o.memory_gb} and price_per_hour "
                              f"{o.price_per_hour}: not an offer", fix)
    return offers


def _offer(row) -> Offer:
    """One row of bin/pod gpus --json (pods/runpod.py): id, memory_gb (a whole number), price_per_hour or null."""
    if not isinstance(row, dict):
        raise ValueError(f"a row is a JSON {type(row).__name__}, not an object with id, memory_gb, price_per_hour")
    for key in ("id", "memory_gb"):
        if key not in row:
            raise ValueError(f"a row has no {key}: {json.dumps(row)[:80]}")
    memory, price = row["memory_gb"], row.get("price_per_hour")
    if isinstance(memory, bool) or not isinstance(memory, (int, float)) or not math.isfinite(memory) \
            or memory != int(memory):
        raise ValueError(f"{row['id']}: memory_gb {memory!r} is not a whole number of GB")
    if price is not None and (isinstance(price, bool) or not isinstance(price, (int, float))):
        raise ValueError(f"{row['id']}: price_per_hour {price!r} is not a number or null")
    return Offer(str(row["id"]), int(memory), None if price is None else float(price))


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a price (bin/pod gpus writes null for a type not for rent)")


def rank(job: JobConfig, offers: list[Offer]) -> list[Ranked]:
    """Every offer, predicted: the ones that fit and are for rent first (cheapest, then most headroom)."""
    out = []
    for offer in offers:
        try:
            spec = gpus.lookup(offer.id)
        except ConfigError:
            out.append(Ranked(offer, None, world_size=job.cluster.world_size, note="not in podkit's GPU catalog"))
            continue
        card_gb = spec.memory_mib / 1024
        if offer.memory_gb and abs(card_gb - offer.memory_gb) > _MEMORY_TOLERANCE * offer.memory_gb:
            out.append(Ranked(offer, None, world_size=job.cluster.world_size,
                              note=f"{offer.memory_gb} GB, catalog's {spec.name} has {card_gb:.0f}: not predicted"))
            continue
        est = memory.estimate(job, spec)
        out.append(Ranked(offer, spec.name, est.total, est.capacity, job.cluster.world_size,
                          "" if offer.price_per_hour is not None else "none free to rent now"))

    def order(r: Ranked):
        priced = r.job_price_per_hour is not None
        return (r.catalog is None, not r.fits, not priced, r.job_price_per_hour or 0.0, r.total_bytes / max(1, r.capacity_bytes), r.offer.id)

    return sorted(out, key=order)
