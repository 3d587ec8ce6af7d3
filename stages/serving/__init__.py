"""Serving: config rendering and escaping, the MLServer runtime that ships in the bundle,
the local server, the load generator, SLOs and plots."""
