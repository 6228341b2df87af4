"""View versions: a changed view definition is a new version, built beside the one serving answers.

Each view of a deployed pipeline has an *active* version (the one serving reads) and at most one
*building* version (computed by the jobs, not read yet). A version is the view's definition under
an internal name: version 1 keeps the view's own name (the tables a pipeline deployed before
versions existed are its version 1); version ``n > 1`` is ``<view>__v<n>``. Every table, Delta view
and checkpoint is named after the internal name, so two versions never share one.

The registry is a JSON document kept in the pipeline's batch metadata row (``lambdalake_batch``):
the batch publish and a version switch are lightweight transactions on that one row, so a publish
never activates a batch that lacks an active view, and a switch never names a batch that lacks
the new version (:mod:`lambdalake.cassandra.active`).

Deploy plans the changes (:func:`plan`): a view added to a live pipeline, or changed, gets a building
version; a removed view leaves the registry at once (serving stops answering it) and its versions'
tables go once the jobs run without it. ``retired`` lists internal names whose tables and
checkpoints are still to drop.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import TypeAdapter

from lambdalake.pipeline import MAX_TABLE_NAME, LatestView, Pipeline, View, WindowedView
from lambdalake.view_types import current_types, held_types, input_types

AnyView = LatestView | WindowedView
_VIEW = TypeAdapter(View)


def internal_name(view: str, version: int) -> str:
    """The name a version's tables, Delta view and checkpoint carry."""
    return view if version == 1 else f"{view}__v{version}"


def public_name(internal: str) -> str:
    """The view's own name, from one of its versions' internal names."""
    return re.sub(r"__v\d+$", "", internal)


def fingerprint(view: AnyView) -> str:
    """What makes two definitions the same version: everything but the name."""
    data = view.model_dump(mode="json", exclude={"name"})
    text = json.dumps(data, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ViewVersion:
    """One version of a view: its number and definition (``definition.name`` is the internal name;
    a windowed one carries the field types it was made with, :mod:`lambdalake.view_types`)."""

    view: str
    version: int
    definition: AnyView

    @property
    def name(self) -> str:
        return self.definition.name

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.definition)

    @property
    def types(self) -> dict[str, str]:
        return self.definition.stored_types if isinstance(self.definition, WindowedView) else {}

    def to_json(self) -> dict[str, Any]:
        # Kept as the file wrote it (validated again when read), under the view's own name.
        out: dict[str, Any] = {
            "version": self.version,
            "definition": self.definition.model_dump(mode="json") | {"name": self.view},
        }
        if self.types:
            out["types"] = self.types
        return out

    @classmethod
    def from_json(cls, view: str, data: dict[str, Any]) -> ViewVersion:
        definition = _VIEW.validate_python(data["definition"])
        return cls.of(definition, int(data["version"]), data.get("types"))

    @classmethod
    def of(cls, view: AnyView, version: int, types: dict[str, str] | None = None) -> ViewVersion:
        definition = view.model_copy(update={"name": internal_name(view.name, version)})
        if isinstance(definition, WindowedView) and types:
            definition = definition.with_stored_types(types)
        return cls(view.name, version, definition)

    def recording(self, types: dict[str, str]) -> ViewVersion:
        """This version with ``types`` as the types it was made with."""
        if not isinstance(self.definition, WindowedView) or types == self.types:
            return self
        return ViewVersion(self.view, self.version, self.definition.with_stored_types(types))


@dataclass
class ViewState:
    """A view's versions: the active one (None while its first version builds), the building one,
    and the highest version number it has had."""

    active: ViewVersion | None = None
    building: ViewVersion | None = None
    last: int = 0


@dataclass
class Registry:
    """Every view's versions, and internal names whose tables and checkpoints are still to drop."""

    views: dict[str, ViewState] = field(default_factory=dict)
    retired: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str | None) -> Registry:
        if not text:
            return cls()
        data = json.loads(text)
        views = {}
        for name, state in data.get("views", {}).items():
            views[name] = ViewState(
                ViewVersion.from_json(name, state["active"]) if state.get("active") else None,
                ViewVersion.from_json(name, state["building"]) if state.get("building") else None,
                int(state.get("last", 0)),
            )
        return cls(views, list(data.get("retired", [])))

    def to_text(self) -> str:
        views = {
            name: {
                "active": s.active.to_json() if s.active else None,
                "building": s.building.to_json() if s.building else None,
                "last": s.last,
            }
            for name, s in sorted(self.views.items())
        }
        return json.dumps({"views": views, "retired": sorted(set(self.retired))}, sort_keys=True)

    @property
    def empty(self) -> bool:
        return not self.views

    def active(self, view: str) -> ViewVersion | None:
        state = self.views.get(view)
        return state.active if state else None

    def building(self) -> list[ViewVersion]:
        return [s.building for s in self.views.values() if s.building is not None]

    def deployed(self) -> list[ViewVersion]:
        """The versions the jobs compute: every active and building one."""
        out = []
        for state in self.views.values():
            out += [v for v in (state.active, state.building) if v is not None]
        return out

    def active_names(self) -> set[str]:
        return {s.active.name for s in self.views.values() if s.active is not None}


def deployed_pipeline(pipeline: Pipeline, registry: Registry) -> Pipeline:
    """``pipeline`` with the views the jobs compute: the file's views where the registry is empty
    (nothing deployed yet, or deployed before versions existed), else every active and building
    version under its internal name, in the file's order where the file still has the view."""
    if registry.empty:
        return pipeline
    order = {v.name: i for i, v in enumerate(pipeline.views)}
    versions = sorted(registry.deployed(), key=lambda v: (order.get(v.view, len(order)), v.version))
    return pipeline.model_copy(update={"views": [v.definition for v in versions]})


ChangeKind = Literal["added", "changed", "removed", "reverted", "registered"]


@dataclass(frozen=True)
class ViewChange:
    """What deploy does to one view."""

    view: str
    kind: ChangeKind
    version: int | None
    detail: str = ""


def plan(pipeline: Pipeline, registry: Registry) -> tuple[Registry, list[ViewChange]]:
    """The registry after deploying ``pipeline``'s views, and what changed.

    On a pipeline's first deploy (an empty registry) every view is active at once. Later, a view
    added or changed is built beside, even when the master dataset is empty: what the master dataset holds can
    change until the speed job restarts with the view (a read of it before the registry's write would be
    trusted after it), and the build reads the master dataset only once the job counts the view. So is a
    windowed view whose table or Spark state the reader schema widens (:mod:`lambdalake.view_types`):
    a new version of the same definition, made with the new types.

    Args:
        pipeline: The pipeline as its file defines it.
        registry: The registry as deployed.
    """
    new = Registry.parse(registry.to_text())
    changes: list[ViewChange] = []
    first = registry.empty
    now = current_types(pipeline)
    for view in pipeline.views:
        state = new.views.setdefault(view.name, ViewState())
        wanted = fingerprint(view)
        types = input_types(view, now)

        def fits(version: ViewVersion | None, wanted: str = wanted) -> bool:
            """Whether ``version`` computes ``view`` as the reader schema has it now."""
            return (
                version is not None
                and version.fingerprint == wanted
                and not held_types(pipeline, version.definition, now)
            )

        if fits(state.active):
            assert state.active is not None
            state.active = state.active.recording(types)  # a widening no column or state sees
            if state.building is not None:  # the change was taken back before its build finished
                new.retired.append(state.building.name)
                changes.append(ViewChange(view.name, "reverted", state.active.version,
                                          f"build of v{state.building.version} dropped"))  # fmt: skip
                state.building = None
            continue
        if fits(state.building):
            assert state.building is not None
            state.building = state.building.recording(types)
            continue  # a build under way (resumed by this deploy)
        version = state.last + 1
        if state.building is not None:
            new.retired.append(state.building.name)
        candidate = ViewVersion.of(view, version, types)
        _check_name_length(pipeline, candidate)
        state.last = version
        if first:
            state.active, state.building = candidate, None
            changes.append(ViewChange(view.name, "registered", version, "active"))
        else:
            state.building = candidate
            kind: ChangeKind = "added" if state.active is None else "changed"
            detail = "building"
            if state.active is not None and state.active.fingerprint == wanted:
                held = held_types(pipeline, state.active.definition, now)
                detail += (
                    " (its stored types widen: "
                    + ", ".join(f"{name} {was} to {now[name]}" for name, was in sorted(held.items()))
                    + ")"
                )
            changes.append(ViewChange(view.name, kind, version, detail))
    for name in sorted(set(new.views) - {v.name for v in pipeline.views}):
        state = new.views[name]  # kept (with no version): its number goes on if it comes back
        gone = [v for v in (state.active, state.building) if v is not None]
        state.active = state.building = None
        new.retired += [v.name for v in gone]
        if gone:
            changes.append(ViewChange(name, "removed", None, ", ".join(f"v{v.version}" for v in gone)))
    return new, changes


def retype_pending(pipeline: Pipeline, registry: Registry) -> list[str]:
    """Views whose active version computes with types the reader schema widened, a new version
    building: the widening schema must not be registered before they switch."""
    now = current_types(pipeline)
    return sorted(
        name
        for name, state in registry.views.items()
        if state.active is not None
        and state.building is not None
        and held_types(pipeline, state.active.definition, now)
    )


def _check_name_length(pipeline: Pipeline, version: ViewVersion) -> None:
    from lambdalake.errors import ConfigurationError

    longest = f"{pipeline.name}__{version.name}__b999999"
    if len(longest) > MAX_TABLE_NAME:
        raise ConfigurationError(
            f"view {version.view!r} version {version.version}: its table names ({longest}) would exceed "
            f"Cassandra's {MAX_TABLE_NAME} characters",
            fix="shorten the view's name (a new name is a new view) or the pipeline's",
        )
