"""The view build's edges (infra/view_build.py): its registry updates are bounded, and a batch that
refuses to run for a reason of the user's is never taken for "nothing to cover yet". Narrow unit tests
(the Cassandra row and the batch are stand-ins); tests/test_view_versions.py builds views for real.
Each failed on the code before its fix."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any

import pytest

import lambdalake.cassandra.active as active
import lambdalake.control.view_build as view_build
from lambdalake.cassandra.active import PipelineMeta
from lambdalake.errors import ConfigurationError, LambdalakeError, NothingToCover
from lambdalake.view_versions import Registry

#: Lost races before the stand-in gives up (the code before looped for ever).
GUARD = 200


@pytest.fixture
def losing(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every registry swap loses its race; the stand-in counts them and gives up after GUARD."""
    calls = [0]

    def swap(*_args: Any) -> bool:
        calls[0] += 1
        if calls[0] > GUARD:
            raise RuntimeError("still retrying: no bound")
        return False

    monkeypatch.setattr(active, "swap_registry", swap)
    monkeypatch.setattr(view_build, "swap_registry", swap, raising=False)
    monkeypatch.setattr(active, "SWAP_FIRST_DELAY_S", 0.001)
    monkeypatch.setattr(active, "SWAP_MAX_DELAY_S", 0.002)
    monkeypatch.setattr(view_build, "connect", lambda _settings: None)
    return calls


def test_a_registry_update_that_always_loses_gives_up_with_the_fix(losing: list[int]) -> None:
    def decide() -> tuple[PipelineMeta, Registry, str]:
        return PipelineMeta(batch=None), Registry(), "written"

    with pytest.raises(LambdalakeError) as lost:
        active.swap_until_applied(None, SimpleNamespace(), "p", decide)  # type: ignore[arg-type]
    assert losing[0] == active.SWAP_ATTEMPTS
    assert "another deploy or view build" in (lost.value.fix or "")


def test_dropping_retired_versions_is_bounded(losing: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    registry = Registry.parse(None)
    registry.retired = ["old__v1"]
    meta = PipelineMeta(batch=None, registry=registry, row_version=1, views_text=registry.to_text())
    monkeypatch.setattr(view_build, "read_meta", lambda *_: meta)
    monkeypatch.setattr(view_build, "delete_folder", lambda _path: False)
    session = SimpleNamespace(
        cluster=SimpleNamespace(
            refresh_schema_metadata=lambda: None,
            metadata=SimpleNamespace(keyspaces={"ks": SimpleNamespace(tables={})}),
        ),
        execute=lambda *_a, **_k: None,
    )
    monkeypatch.setattr(view_build, "connect", lambda _settings: session)
    settings = SimpleNamespace(storage_root="/tmp/nowhere", cassandra=SimpleNamespace(keyspace="ks"))
    pipeline = SimpleNamespace(name="p")
    with pytest.raises(LambdalakeError):
        view_build.drop_retired(settings, pipeline, lambda _msg: None)  # type: ignore[arg-type]
    assert losing[0] == active.SWAP_ATTEMPTS


def _batch_refusing(monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    """The batch run raises ``error``; no batch is active; the switch finds nothing to switch."""
    import lambdalake.batch.job

    class Refusing:
        def __init__(self, **_kwargs: Any) -> None:
            pass

        def run(self, **_kwargs: Any) -> None:
            raise error

    monkeypatch.setattr(lambdalake.batch.job, "BatchJob", Refusing)
    monkeypatch.setattr(view_build, "connect", lambda _settings: None)
    monkeypatch.setattr(view_build, "with_deployed_views", lambda _s, _k, p: p)
    monkeypatch.setattr(view_build, "writer_lease", lambda *_a, **_k: contextlib.nullcontext())
    monkeypatch.setattr(view_build, "read_meta", lambda *_a: PipelineMeta(batch=None))
    monkeypatch.setattr(view_build, "_switch", lambda *_a: [])


def _build(monkeypatch: pytest.MonkeyPatch) -> Any:
    settings = SimpleNamespace(cassandra=SimpleNamespace(keyspace="ks"))
    pipeline = SimpleNamespace(name="p")
    return view_build._batch_and_switch(settings, pipeline, [], None, lambda _msg: None)  # type: ignore[arg-type]


def test_a_batch_refused_for_the_users_reason_is_raised_even_before_any_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Measured before: any ConfigurationError of the batch (a broken expectations file, a bad
    setting) was swallowed while no batch was active, and the build switched as if all were well."""
    _batch_refusing(monkeypatch, ConfigurationError("expectations file is not JSON", fix="correct it"))
    with pytest.raises(ConfigurationError, match="expectations file"):
        _build(monkeypatch)


def test_a_batch_with_nothing_to_cover_yet_lets_the_switch_go_on(monkeypatch: pytest.MonkeyPatch) -> None:
    _batch_refusing(monkeypatch, NothingToCover("the master dataset has not archived epoch 3 whole"))
    assert _build(monkeypatch) == []
