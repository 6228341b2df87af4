"""Which definition of a pipeline the operations run."""

from __future__ import annotations

from lambdalake.pipeline import Pipeline, configured_pipeline
from lambdalake.settings import Settings


def deployed_pipeline(settings: Settings, name: str) -> Pipeline:
    """The pipeline ``name`` with the view versions its jobs compute (:mod:`lambdalake.view_versions`):
    the active and building ones, which differ from the file's while a changed view builds.

    Raises:
        ConfigurationError: no such pipeline file, or the file is not valid.
    """
    from lambdalake.cassandra.active import with_deployed_views
    from lambdalake.cassandra.session import connect

    pipeline = configured_pipeline(name, settings)
    return with_deployed_views(connect(settings.cassandra), settings.cassandra.keyspace, pipeline)


def quiet(_step: str) -> None:
    """The default progress callback of the operations: report nothing."""
