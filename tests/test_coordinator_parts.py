"""The coordinator's parts (issue 45): each is held to the coordinator's own rules (it asks for
reductions, never unpickles or runs a reduce function), and the route table sends every kind a
bound member sends to a part's handler."""

import os

from test_code_quality import ROOT, _rules_breaches

from zcollective._format._wire import Kind
from zcollective._protocol._coordinator import Coordinator

PARTS = ("_coordinator", "_parts", "_joining", "_membership", "_matching", "_climbing", "_endings", "_stalls")


def test_every_part_of_the_coordinator_only_decides():
    found = []
    for name in PARTS:
        with open(os.path.join(ROOT, "zcollective", "_protocol", name + ".py"), encoding="utf-8") as f:
            found += [(name, *hit) for hit in _rules_breaches(f.read(), coordinator=True)]
    assert not found, f"parts of the coordinator that act instead of deciding: {found}"


def test_the_route_table_names_a_part_for_each_kind_a_member_sends():
    coord = Coordinator(2, 0x5E55, 16)
    routes = coord._routes
    assert set(routes) == {Kind.CONTRIB, Kind.UP, Kind.SYNC, Kind.ABORT, Kind.BYE, Kind.TAKEN, Kind.FINAL,
                           Kind.STATUS}
    parts = {coord.joining, coord.membership, coord.calls, coord.climb, coord.endings, coord.watch}
    assert all(handler.__self__ in parts for handler in routes.values())
