"""Realistic synthetic events for the example pipelines.

Streams have what real feeds have: skewed keys (a few hot offers and vehicles), many updates of the
same key, event times out of order and some days late, exact duplicates (a producer retry upstream),
and a share of invalid records of several kinds. Everything is drawn from one seeded RNG, so a seed
reproduces the stream (event times are relative to the clock passed in).
"""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

DAY_MS = 86_400_000
CURRENCIES = ["EUR", "USD", "GBP", "INR", "JPY", "CHF"]


#: Telemetry event times of a stream fall on its seed modulo this many milliseconds.
SEED_SPACING = 16


@dataclass(frozen=True)
class Mix:
    """Shares of the stream, each in [0, 1).

    Args:
        duplicates: Records re-sent exactly as an earlier valid one. Default 0.02.
        invalid: Records that break a schema type or a pipeline rule. Default 0.01.
        late: Valid records whose event time is 1-5 days old. Default 0.02.
        out_of_order_ms: Event times jitter up to this far behind the clock. Default 120 000.
    """

    duplicates: float = 0.02
    invalid: float = 0.01
    late: float = 0.02
    out_of_order_ms: int = 120_000


class Zipf:
    """Draws ranks 0..n-1 with probability proportional to 1/(rank+1)^s (a few keys are hot)."""

    def __init__(self, n: int, s: float, rng: random.Random) -> None:
        self._cum = list(itertools.accumulate(1.0 / (k + 1) ** s for k in range(n)))
        self._rng = rng

    def __call__(self) -> int:
        return bisect.bisect_left(self._cum, self._rng.random() * self._cum[-1])


class EventStream:
    """Shared mechanics: duplicates, invalid and late records around a pipeline's valid events."""

    corruptions: list[tuple[str, Callable[[dict[str, Any], random.Random, int], None]]] = []
    time_field: str = ""

    def __init__(self, n: int, *, seed: int, mix: Mix, clock: Callable[[], float]) -> None:
        self.n, self.mix, self.clock, self.seed = n, mix, clock, seed
        self.rng = random.Random(seed)
        self._recent: list[dict[str, Any]] = []

    def valid(self, now_ms: int, late: bool) -> dict[str, Any]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[dict[str, Any]]:
        rng, mix = self.rng, self.mix
        for _ in range(self.n):
            now_ms = int(self.clock() * 1000)
            roll = rng.random()
            if roll < mix.duplicates and self._recent:
                yield dict(rng.choice(self._recent))
                continue
            record = self.valid(now_ms, late=rng.random() < mix.late)
            if roll < mix.duplicates + mix.invalid:
                _name, corrupt = self.corruptions[rng.randrange(len(self.corruptions))]
                corrupt(record, rng, now_ms)
                yield record
                continue
            if len(self._recent) < 1000:
                self._recent.append(record)
            else:
                self._recent[rng.randrange(1000)] = record
            yield dict(record)

    def event_time(self, now_ms: int, late: bool) -> int:
        if late:
            return now_ms - self.rng.randint(DAY_MS, 5 * DAY_MS)
        return now_ms - self.rng.randint(0, self.mix.out_of_order_ms)


def set_field(field: str, value: Any) -> Callable[[dict[str, Any], random.Random, int], None]:
    def corrupt(r: dict[str, Any], _rng: random.Random, _now: int) -> None:
        r[field] = value

    return corrupt


def _drop(field: str) -> Callable[[dict[str, Any], random.Random, int], None]:
    def corrupt(r: dict[str, Any], _rng: random.Random, _now: int) -> None:
        r.pop(field, None)

    return corrupt


def future_field(field: str) -> Callable[[dict[str, Any], random.Random, int], None]:
    def corrupt(r: dict[str, Any], _rng: random.Random, now: int) -> None:
        r[field] = now + DAY_MS

    return corrupt


class OfferStream(EventStream):
    """Offer updates: each update of an offer carries the next version of it (its time in ms, or one
    more than the offer's previous version when updates come faster than the clock)."""

    time_field = "updated_at"
    corruptions = [
        ("negative price", set_field("price_cents", -500)),
        ("unknown currency", set_field("currency", "XXX")),
        ("missing offer id", set_field("offer_id", "")),
        ("future time", future_field("updated_at")),
        ("wrong type", set_field("price_cents", "12.99")),
        ("unknown status", set_field("status", "deleted")),
        ("missing field", _drop("title")),
    ]

    def __init__(self, n: int, *, seed: int, mix: Mix, clock: Callable[[], float]) -> None:
        super().__init__(n, seed=seed, mix=mix, clock=clock)
        self.n_offers = max(10, n // 20)
        self.n_merchants = max(5, self.n_offers // 10)
        self.pick_offer = Zipf(self.n_offers, 1.1, self.rng)
        self.pick_merchant = Zipf(self.n_merchants, 1.2, self.rng)
        self.offers: dict[int, dict[str, Any]] = {}

    def valid(self, now_ms: int, late: bool) -> dict[str, Any]:
        rng = self.rng
        k = self.pick_offer()
        offer = self.offers.get(k)
        if offer is None:
            offer = self.offers[k] = {
                "merchant_id": f"merchant-{self.pick_merchant():04d}",
                "title": f"{rng.choice(['Red', 'Blue', 'Eco', 'Pro', 'Mini'])} "
                f"{rng.choice(['kettle', 'lamp', 'backpack', 'headphones', 'chair'])} #{k}",
                "base": rng.randint(199, 99_999),
                "currency": rng.choice(CURRENCIES),
                "version": 0,
            }
        # Versioned by modification time, as many source systems do: a later run's updates of an offer
        # get higher versions than an earlier run's, never the same (offer, version) for new content.
        offer["version"] = max(offer["version"] + 1, now_ms)
        return {
            "offer_id": f"offer-{k:06d}",
            "merchant_id": offer["merchant_id"],
            "title": offer["title"],
            "price_cents": max(0, offer["base"] + rng.randint(-offer["base"] // 5, offer["base"] // 5)),
            "currency": offer["currency"],
            "stock": rng.randint(0, 500),
            "status": "withdrawn" if rng.random() < 0.05 else "active",
            "version": offer["version"],
            "updated_at": self.event_time(now_ms, late),
            "promo_code": rng.choice([None, None, None, "SPRING10", "VIP"]),
        }


class TelemetryStream(EventStream):
    """EDR readings: each vehicle drives a random walk; (vehicle, event time) identifies a reading."""

    time_field = "event_time"
    corruptions = [
        ("negative speed", set_field("speed_kmh", -12.0)),
        ("impossible speed", set_field("speed_kmh", 999.0)),
        ("heading out of range", set_field("heading_deg", 400.0)),
        ("latitude out of range", set_field("latitude", 123.4)),
        ("missing vehicle id", _drop("vehicle_id")),
        ("future time", future_field("event_time")),
        ("wrong type", set_field("odometer_km", "far")),
    ]

    def __init__(self, n: int, *, seed: int, mix: Mix, clock: Callable[[], float]) -> None:
        super().__init__(n, seed=seed, mix=mix, clock=clock)
        self.n_vehicles = max(10, n // 50)
        self.pick = Zipf(self.n_vehicles, 0.8, self.rng)
        self.vehicles: dict[int, dict[str, Any]] = {}
        self._used: set[tuple[int, int]] = set()

    def valid(self, now_ms: int, late: bool) -> dict[str, Any]:
        rng = self.rng
        k = self.pick()
        v = self.vehicles.get(k)
        if v is None:
            v = self.vehicles[k] = {
                "speed": rng.uniform(0, 90), "heading": rng.uniform(0, 359.9),
                "lat": rng.uniform(47.0, 54.0), "lon": rng.uniform(6.0, 14.0),
                "odo": rng.uniform(1_000, 250_000),
            }  # fmt: skip
        v["speed"] = min(220.0, max(0.0, v["speed"] + rng.gauss(0, 8)))
        v["heading"] = (v["heading"] + rng.gauss(0, 10)) % 360.0
        v["lat"] = min(89.0, max(-89.0, v["lat"] + rng.gauss(0, 0.001)))
        v["lon"] = min(179.0, max(-179.0, v["lon"] + rng.gauss(0, 0.001)))
        v["odo"] += v["speed"] / 3600.0
        # A distinct reading has an identity of its own, in this stream and in any other whose seed
        # differs modulo SEED_SPACING: its event time is the seed modulo SEED_SPACING ms, so a second
        # wave of late readings never reuses a first wave's identity by chance.
        ts = self.event_time(now_ms, late)
        ts -= (ts - self.seed) % SEED_SPACING
        while (k, ts) in self._used:
            ts -= SEED_SPACING
        self._used.add((k, ts))
        return {
            "vehicle_id": f"vehicle-{k:05d}",
            "event_time": ts,
            "speed_kmh": round(v["speed"], 2),
            "heading_deg": round(v["heading"], 2) % 360.0,
            "latitude": round(v["lat"], 6),
            "longitude": round(v["lon"], 6),
            "engine_state": "idle" if v["speed"] < 1 else rng.choice(["running"] * 9 + ["off"]),
            "odometer_km": round(v["odo"], 3),
            "fuel_level_pct": round(rng.uniform(5, 100), 1) if rng.random() < 0.7 else None,
        }


STREAMS: dict[str, type[EventStream]] = {"offers": OfferStream, "telemetry": TelemetryStream}


def generate(
    kind: str, n: int, *, seed: int = 0, mix: Mix | None = None, clock: Callable[[], float] | None = None
) -> Iterator[dict[str, Any]]:
    """``n`` synthetic records of the generator ``kind`` (see the pipeline's ``[generator]``)."""
    import time

    return iter(STREAMS[kind](n, seed=seed, mix=mix or Mix(), clock=clock or time.time))
