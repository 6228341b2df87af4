"""The serving layer: one exact answer per key from the batch and speed views (no Spark needed).

from lambdalake.serving import ServingClient
answer = ServingClient(settings=get_settings()).query("offers", "merchant_offers_hourly", "merchant-0001")
"""

from lambdalake.serving.answers import Answer, LatestRow, Provenance, WindowRow
from lambdalake.serving.client import NotFound, ServingClient

__all__ = ["Answer", "LatestRow", "NotFound", "Provenance", "ServingClient", "WindowRow"]
