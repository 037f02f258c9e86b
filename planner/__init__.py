"""The planner: the policy that moves a disaggregated deployment's prefill:decode split and its
local prefill bound while traffic shifts, and the two loops that run it.

policy.py decides from Signals and holds no clock, thread or RPC of its own; local_prefill.py is
the per-request rule the bound feeds. actuator.py is the small interface both loops act through
(flip workers from one pool to the other, set the local prefill bound) and the one function that
carries a decision out through it. live.py is the loop a running router starts (its actuator is
in router/), simulated.py the loop the simulator ticks (its actuator is in tuning/), so the same
policy code decides in both. This package imports neither the router nor the tuner: they import
it.
"""
