"""Placements are immutable values (AUDIT code-quality rows)."""

import pickle

import pytest

from hpservice.dtensor import Partial, Placement, Replicate, Shard


def test_audit_row_shard_and_replicate_hash_differ():
    assert hash(Shard(0)) != hash(Replicate())
    assert len({Shard(0), Replicate(), Partial(), Partial("max"), Shard(1)}) == 5
    assert Shard(0) != Replicate() and Replicate() != Partial() and Shard(0) != Partial()


def test_equality_by_value():
    assert Shard(1) == Shard(1) and hash(Shard(1)) == hash(Shard(1))
    assert Partial("avg") == Partial("avg") and Partial("avg") != Partial("sum")
    assert Replicate() == Replicate()
    assert {Shard(2): "x"}[Shard(2)] == "x"


def test_audit_row_partial_str_keeps_reduce_op():
    assert str(Partial()) == "P(sum)"
    assert str(Partial("max")) == "P(max)"
    assert str(Partial("avg")) == "P(avg)" and str(Partial("min")) == "P(min)"


def test_repr_and_str():
    assert repr(Shard(0)) == "Shard(dim=0)" and str(Shard(0)) == "S(0)"
    assert repr(Replicate()) == "Replicate()" and str(Replicate()) == "R"
    assert repr(Partial()) == "Partial(reduce_op='sum')"


def test_immutable():
    with pytest.raises(AttributeError):
        Shard(0).dim = 1
    with pytest.raises(AttributeError):
        Partial().reduce_op = "max"


def test_predicates_are_methods_that_answer():
    # AUDIT 1: `if layout.is_partial:` (no call) was always true.
    assert Partial().is_partial() and not Shard(0).is_partial() and not Replicate().is_partial()
    assert Shard(1).is_shard() and Shard(1).is_shard(1) and not Shard(1).is_shard(0)
    assert Replicate().is_replicate() and not Shard(0).is_replicate()
    assert Partial("max").is_partial("max") and not Partial("max").is_partial("sum")


def test_bad_arguments_are_clear():
    with pytest.raises(ValueError, match="allowed: sum, avg, max, min"):
        Partial("prod")
    with pytest.raises(TypeError, match="dim must be an int"):
        Shard("0")


def test_pickle_roundtrip():
    for p in (Shard(3), Replicate(), Partial("min")):
        q = pickle.loads(pickle.dumps(p))
        assert q == p and hash(q) == hash(p) and isinstance(q, Placement)
