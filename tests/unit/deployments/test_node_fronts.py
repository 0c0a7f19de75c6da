"""Which nodes get a front of their own, and what each one binds (deployments/node_fronts.py);
the fronts themselves on two nodes are tested in tests/integration/test_two_nodes.py."""

from __future__ import annotations

from rayinfer.deployments.node_fronts import front_nodes, node_endpoint

OWN = "10.0.0.1"


def test_an_address_of_the_v2_replicas_node_becomes_each_nodes_own():
    assert node_endpoint(("10.0.0.1", 8000, "10.0.0.1", 9000), OWN, "10.0.0.7") == ("10.0.0.7", 8000, "10.0.0.7", 9000)


def test_wildcard_and_loopback_addresses_are_the_same_on_every_node():
    assert node_endpoint(("0.0.0.0", 8000, "127.0.0.1", 9000), OWN, "10.0.0.7") == ("0.0.0.0", 8000, "127.0.0.1", 9000)
    assert node_endpoint(("::", 8001, "127.0.0.1", 9001), OWN, "10.0.0.7") == ("::", 8001, "127.0.0.1", 9001)
    loopback = ("127.0.0.1", 8000, "127.0.0.1", 9000)
    assert node_endpoint(loopback, OWN, "10.0.0.7") == loopback
    assert node_endpoint(None, OWN, "10.0.0.7") is None


def test_a_front_goes_to_each_other_node_with_a_routed_replica():
    routes = {"simple/1": [("10.0.0.1", 30001), ("10.0.0.2", 30001)], "other/1": [("10.0.0.3", 30002)]}
    nodes = {"10.0.0.1": ["head"], "10.0.0.2": ["a"], "10.0.0.3": ["b"], "10.0.0.4": ["idle"]}
    assert front_nodes(routes, nodes, OWN) == {"a": "10.0.0.2", "b": "10.0.0.3"}


def test_nodes_sharing_an_address_get_no_front_of_their_own():
    """Ray nodes started on one machine share its ports: a second front there could not bind."""
    routes = {"simple/1": [("10.0.0.1", 30001), ("10.0.0.1", 30002), ("10.0.0.2", 30003)]}
    nodes = {"10.0.0.1": ["head", "worker"], "10.0.0.2": ["a", "b"]}
    assert front_nodes(routes, nodes, OWN) == {}
