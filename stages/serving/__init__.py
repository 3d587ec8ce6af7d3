"""Serving: config rendering and escaping, the MLServer runtime, front door, Triton entry
and generation engine that ship in the bundle, and starting a bundle's servers locally.
The load test against them is its own subsystem: stages/loadtesting."""
