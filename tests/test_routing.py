"""The routing rule: a longer hit wins among equally busy replicas; a
replica d requests busier must offer more than d * queued_request_tokens
more hit; ties spread in turn."""

import pytest

from hybridkv.core.routing import RoutingRule


def test_longer_hit_wins_when_queues_are_equal():
    rule = RoutingRule(queued_request_tokens=100)
    assert rule.choose(1000, ["a", "b"], {"a": 200, "b": 600}, {"a": 2, "b": 2}) == "b"


def test_a_far_busier_replica_loses_to_a_shorter_hit():
    rule = RoutingRule(queued_request_tokens=100)
    # "a" saves 500 tokens more but is 6 requests busier: 6 * 100 > 500.
    assert rule.choose(1000, ["a", "b"], {"a": 500}, {"a": 6}) == "b"
    # 4 requests busier: 400 < 500, the hit still wins.
    assert rule.choose(1000, ["a", "b"], {"a": 500}, {"a": 4}) == "a"


def test_ties_spread_in_turn_like_round_robin():
    rule = RoutingRule()
    picks = [rule.choose(10, ["a", "b", "c"], {}, {}) for _ in range(30)]
    assert sorted(picks.count(r) for r in "abc") == [10, 10, 10]


def test_ties_in_cost_go_to_the_shorter_queue():
    rule = RoutingRule(queued_request_tokens=0)
    for _ in range(5):
        assert rule.choose(100, ["a", "b"], {}, {"a": 3, "b": 1}) == "b"


def test_bad_input_is_refused():
    with pytest.raises(ValueError):
        RoutingRule(-1)
    with pytest.raises(ValueError):
        RoutingRule().choose(10, [], {}, {})
