"""What deploy, undeploy and a view build did: one typed record per thing looked at."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Action = Literal["created", "updated", "started", "restarted", "stopped", "removed", "held", "unchanged"]


@dataclass(frozen=True)
class Change:
    """One thing deploy looked at: what it is, what happened, and a detail for people."""

    what: str
    action: Action
    detail: str = ""

    @property
    def changed(self) -> bool:
        return self.action != "unchanged"
