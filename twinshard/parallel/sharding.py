"""A value's sharding checked against a declared spec, at trace time when JAX's Explicit mode
puts the sharding in its type: the explicit twin's hooks run it. It lives in twinshard.testing,
with the other assertions that install alone (the twinshard-hlo distribution)."""

from twinshard.testing import expect_sharding

__all__ = ["expect_sharding"]
