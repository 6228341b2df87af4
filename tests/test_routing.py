"""Narrow tests of the coordinator routing (``lambdalake.cassandra.routing``): which errors mean a
coordinator lags the schema, and that hosts on probation are tried last. The real case, a node
returning after a publish while clients query, is in ``tests/test_cluster.py``."""

from __future__ import annotations

import time

from cassandra import ConsistencyLevel, InvalidRequest, ReadFailure, WriteFailure
from cassandra.policies import LoadBalancingPolicy
from cassandra.protocol import ServerError

from lambdalake.cassandra.routing import SchemaLagPolicy, lags_schema, missing_table, replica_lacks_schema


class Fixed(LoadBalancingPolicy):
    """A child policy with a fixed plan: the hosts in the order given."""

    def __init__(self, hosts: list[str]) -> None:
        super().__init__()
        self.hosts = hosts

    def make_query_plan(self, working_keyspace=None, query=None):
        return iter(self.hosts)

    def on_up(self, host) -> None:
        pass

    def on_add(self, host) -> None:
        pass


def test_a_host_that_came_up_or_lagged_is_tried_last_until_its_probation_ends() -> None:
    policy = SchemaLagPolicy(Fixed(["a", "b", "c"]), probation_s=0.3)
    assert list(policy.make_query_plan()) == ["a", "b", "c"]
    policy.on_up("a")
    assert list(policy.make_query_plan()) == ["b", "c", "a"]
    policy.suspect("c")
    assert list(policy.make_query_plan()) == ["b", "a", "c"]
    time.sleep(0.35)
    assert list(policy.make_query_plan()) == ["a", "b", "c"]


def test_which_errors_are_a_coordinator_lagging_the_schema() -> None:
    five = InvalidRequest(
        'Error from server: code=2200 [Invalid query] message="table wallet__w5__b1 does not exist"'
    )
    older = InvalidRequest(
        'Error from server: code=2200 [Invalid query] message="unconfigured table wallet__w5__b1"'
    )
    assert missing_table(five) == missing_table(older) == "wallet__w5__b1"
    assert lags_schema(five, {"wallet__w5__b1"})
    # A table nobody says exists is the request's error (a view not deployed), not a lag.
    assert not lags_schema(five, {"other"}) and not lags_schema(five, None)
    assert lags_schema(ServerError(0, "Unknown CF 5e0b4a10-...", None), None)
    assert not lags_schema(InvalidRequest("Undefined column name x"), {"wallet__w5__b1"})
    assert not lags_schema(ServerError(0, "java.lang.NullPointerException", None), None)


def test_a_replica_that_has_not_seen_the_table_is_told_from_other_failures() -> None:
    # As the driver builds them from a protocol-v5 failure: the replicas' reasons by address.
    lacking = ReadFailure(
        "Replica(s) failed to execute read", consistency=ConsistencyLevel.QUORUM, required_responses=2,
        received_responses=1, failures=1, error_code_map={"127.0.0.3": 3},
    )  # fmt: skip
    tombstones = ReadFailure("Replica(s) failed to execute read", failures=1, error_code_map={"127.0.0.3": 1})
    assert replica_lacks_schema(lacking)
    assert not replica_lacks_schema(tombstones)
    assert replica_lacks_schema(WriteFailure("failed: INCOMPATIBLE_SCHEMA from /127.0.0.2"))
    assert not replica_lacks_schema(InvalidRequest("INCOMPATIBLE_SCHEMA"))  # not a replica's failure
