"""The quality gate: a suite of expectations per pipeline, in Great Expectations' terms, run on the
master dataset slice a batch covers and on each rebuilt view before anything is committed or published.

The suite is derived from the pipeline definition (columns, nulls, the rules' ranges and allowed
values, each view's key uniqueness, row counts against the previous version) plus what the file
``pipelines/<pipeline>.expectations.json`` beside the definition adds::

    {"row_count_tolerance": 0.5,
     "master": [{"type": "expect_column_values_to_not_be_null", "kwargs": {"column": "title"}}],
     "views": {"offer_latest": [{"type": "...", "kwargs": {...}}]}}

A failed expectation stops the run before the Delta commits and the publish (serving keeps the
previous version); a Markdown report under ``<storage_root>/reports/<pipeline>/`` names each one.
The kinds above are judged in one Spark aggregation per dataset (:mod:`batch.expectations`); any
other Great Expectations kind the file names runs through Great Expectations itself.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame

from lambdalake.batch.expectations import Spec, Verdict, evaluate, identify, is_native
from lambdalake.errors import LambdalakeError
from lambdalake.pipeline import AllowedRule, LatestView, Pipeline, RangeRule, RequiredRule, WindowedView
from lambdalake.spark.views import INGEST_TS
from lambdalake.storage import write_text
from lambdalake.view_versions import public_name
from lambdalake.views import WINDOW_START, view_components

log = logging.getLogger("lambdalake.batch")

#: The keys of ``<pipeline>.expectations.json``.
SUITE_KEYS = frozenset({"row_count_tolerance", "master", "views"})

#: A row count may move this much (as a share) from the previous version's before the gate fails.
DEFAULT_ROW_COUNT_TOLERANCE = 0.5


@dataclass(frozen=True)
class Outcome:
    dataset: str
    expectation: str
    column: str | None
    success: bool
    detail: str


@dataclass
class GateReport:
    outcomes: list[Outcome] = field(default_factory=list)
    path: str | None = None

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.success]


class QualityGateFailed(LambdalakeError):
    """Expectations failed: the run stopped before committing or publishing anything."""


def suite_file(pipelines_dir: Path, pipeline: str) -> Path:
    return pipelines_dir / f"{pipeline}.expectations.json"


def _extra(pipelines_dir: Path, pipeline: str) -> dict[str, Any]:
    path = suite_file(pipelines_dir, pipeline)
    if not path.exists():
        return {}
    try:
        extra = json.loads(path.read_text())
    except ValueError as exc:
        raise LambdalakeError(
            f"{path} is not JSON: {exc}", fix="correct the file (see batch/quality.py)"
        ) from None
    unknown = sorted(set(extra) - SUITE_KEYS) if isinstance(extra, dict) else ["(not an object)"]
    if unknown:
        # A misspelt key, or one of an older layout ("bronze" before 0.2.0), would otherwise be a
        # check silently not run.
        raise LambdalakeError(
            f"{path}: unknown key(s) {', '.join(unknown)}",
            fix=f"use only {', '.join(sorted(SUITE_KEYS))} (see docs/layers.md, 'Quality gate')",
        )
    return extra


def _nullable_fields(pipeline: Pipeline) -> frozenset[str]:
    """Top-level fields whose reader-schema type admits null (a union with ``null``)."""
    return frozenset(
        f["name"]
        for f in pipeline.reader_schema["fields"]
        if f["type"] == "null" or (isinstance(f["type"], list) and "null" in f["type"])
    )


def master_expectations(pipeline: Pipeline) -> list[Spec]:
    """Schema, nulls and the pipeline's rules, on the events a batch covers."""
    out: list[Spec] = [
        {"type": "expect_column_to_exist", "kwargs": {"column": c}}
        for c in [*pipeline.reader_fields, INGEST_TS, "_partition", "_offset"]
    ]
    # What the edge took is what the batch takes: a field of the event's key, time or identity must be
    # set only where the schema says so (a null there is a reference the producer may leave out, and
    # the speed layer counts it); a ``required`` rule makes any field so.
    declared = [pipeline.event.key, pipeline.event.time, *pipeline.event.identity]
    optional = _nullable_fields(pipeline)
    required = [*(c for c in declared if c not in optional), INGEST_TS, "_offset"]
    required += [r.field for r in pipeline.rules if isinstance(r, RequiredRule)]
    out += [
        {"type": "expect_column_values_to_not_be_null", "kwargs": {"column": c}}
        for c in dict.fromkeys(required)
    ]
    for rule in pipeline.rules:
        if isinstance(rule, RangeRule):
            kwargs: dict[str, Any] = {"column": rule.field, "min_value": rule.min, "max_value": rule.max}
            if not rule.max_inclusive:
                kwargs["strict_max"] = True
            out.append({"type": "expect_column_values_to_be_between", "kwargs": kwargs})
        elif isinstance(rule, AllowedRule):
            out.append(
                {
                    "type": "expect_column_values_to_be_in_set",
                    "kwargs": {"column": rule.field, "value_set": rule.values},
                }
            )
    return out


def view_expectations(
    view: LatestView | WindowedView, previous_rows: int | None, tolerance: float
) -> list[Spec]:
    """Key uniqueness and non-null keys; counts of at least 1; row count near the previous version's."""
    key = [*view.key] if isinstance(view, LatestView) else [*view.key, WINDOW_START]
    out: list[Spec] = [{"type": "expect_column_values_to_not_be_null", "kwargs": {"column": c}} for c in key]
    if len(key) == 1:
        out.append({"type": "expect_column_values_to_be_unique", "kwargs": {"column": key[0]}})
    else:
        out.append({"type": "expect_compound_columns_to_be_unique", "kwargs": {"column_list": key}})
    if isinstance(view, WindowedView):
        for c in view_components(view):
            if c.fn == "count" and c.source is None:
                out.append(
                    {
                        "type": "expect_column_values_to_be_between",
                        "kwargs": {"column": c.column, "min_value": 1},
                    }
                )
    if previous_rows:
        low, high = int(previous_rows * (1 - tolerance)), int(previous_rows * (1 + tolerance)) + 1
        out.append(
            {"type": "expect_table_row_count_to_be_between", "kwargs": {"min_value": low, "max_value": high}}
        )
    return out


class QualityGate:
    """Runs the pipeline's suite on Spark DataFrames: the kinds :mod:`batch.expectations` knows in
    one aggregation per dataset, any other kind the file names with Great Expectations (an ephemeral
    context, made only when one is met).

    Args:
        pipeline: The pipeline (its rules and views define the suite).
        pipelines_dir: Where ``<pipeline>.expectations.json`` is looked for.
    """

    def __init__(self, pipeline: Pipeline, pipelines_dir: Path) -> None:
        self.pipeline = pipeline
        self.extra = _extra(pipelines_dir, pipeline.name)
        self.tolerance = float(self.extra.get("row_count_tolerance", DEFAULT_ROW_COUNT_TOLERANCE))
        self._gx_source: Any = None
        self.report = GateReport()

    def check(self, dataset: str, df: DataFrame, specs: list[Spec]) -> None:
        """Validate ``df`` against ``specs`` and the file's extras for ``dataset``; record outcomes."""
        extra = (
            self.extra.get("master", [])
            if dataset == "master"
            else self.extra.get("views", {}).get(public_name(dataset), [])
        )
        # One outcome per distinct expectation, as a Great Expectations suite keeps it (the file may
        # repeat one the pipeline already implies).
        every = list(
            {
                identify(spec): {"type": spec["type"], "kwargs": dict(spec.get("kwargs", {}))}
                for spec in [*specs, *extra]
            }.values()
        )
        native = [spec for spec in every if is_native(spec)]
        verdicts = {identify(v.spec): v for v in evaluate(df, native)}
        others = [spec for spec in every if not is_native(spec)]
        if others:
            verdicts.update({identify(v.spec): v for v in self._great_expectations(dataset, df, others)})
        for spec in every:
            verdict = verdicts[identify(spec)]
            self.report.outcomes.append(
                Outcome(
                    dataset,
                    spec["type"],
                    spec["kwargs"].get("column"),
                    verdict.success,
                    json.dumps(verdict.result, default=str)[:300],
                )
            )

    def _great_expectations(self, dataset: str, df: DataFrame, specs: list[Spec]) -> list[Verdict]:
        import great_expectations as gx
        from great_expectations.expectations.expectation_configuration import ExpectationConfiguration

        if self._gx_source is None:
            from great_expectations.data_context.types.base import ProgressBarsConfig

            context = gx.get_context(mode="ephemeral")
            context.variables.progress_bars = ProgressBarsConfig(globally=False)
            # The batch job caches what it checks: GE's own persist would copy the master dataset slice into
            # a second cache, never freed, and the first check would pay for the copy.
            self._gx_source = context.data_sources.add_spark(name="lambdalake", persist=False)
        asset = self._gx_source.add_dataframe_asset(name=dataset)
        whole = asset.add_batch_definition_whole_dataframe("all")
        batch = whole.get_batch(batch_parameters={"dataframe": df})

        def suite(configs: list) -> Any:
            out = gx.ExpectationSuite(name=f"{self.pipeline.name}-{dataset}")
            for config in configs:
                out.add_expectation(config.to_domain_obj())
            return out

        configs = [ExpectationConfiguration(type=spec["type"], kwargs=spec["kwargs"]) for spec in specs]

        # Pass or fail first (no unexpected-value samples: those cost Spark jobs of their own per
        # expectation), then the details of the failed ones only, for the report.
        def key(result: Any) -> str:
            config = result.expectation_config
            return identify({"type": config.type, "kwargs": config.kwargs})

        first = {key(r): r for r in batch.validate(suite(configs), result_format="BOOLEAN_ONLY").results}
        failed = [r.expectation_config for r in first.values() if not r.success]
        details = {}
        if failed:
            details = {key(r): r for r in batch.validate(suite(failed), result_format="BASIC").results}
        out = []
        for spec in specs:
            verdict = first[identify(spec)]
            r = details.get(identify(spec), verdict)
            detail = {
                k: v
                for k, v in (r.result or {}).items()
                if k in ("observed_value", "unexpected_count", "partial_unexpected_list")
            }
            out.append(Verdict(spec, bool(verdict.success), detail))
        return out

    def finish(self, report_path: str) -> GateReport:
        """Write the report; raise :class:`QualityGateFailed` naming every failed expectation."""
        lines = [
            f"# Quality gate: {self.pipeline.name}",
            "",
            "| dataset | expectation | column | result | detail |",
            "|---|---|---|---|---|",
        ]
        for o in self.report.outcomes:
            verdict = "pass" if o.success else "**FAIL**"
            lines.append(f"| {o.dataset} | {o.expectation} | {o.column or ''} | {verdict} | `{o.detail}` |")
        write_text(report_path, "\n".join(lines) + "\n")
        self.report.path = report_path
        failed = self.report.failed
        if failed:
            names = "; ".join(
                f"{o.dataset}: {o.expectation}({o.column or ''}) {o.detail}" for o in failed[:10]
            )
            raise QualityGateFailed(
                f"quality gate failed, {len(failed)} expectation(s): {names}",
                fix=f"read {report_path}; correct the data (or the expectation in "
                f"pipelines/{self.pipeline.name}.expectations.json), then run the batch again; serving keeps "
                "the previous version",
            )
        return self.report
