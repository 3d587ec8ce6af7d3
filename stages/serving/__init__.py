"""Serving, the build side: the serve stage's values and the shipped runtime's settings
(`configs`), built from the spec, the model's facts and the capacity plan, and checked. The
runtime itself is the top-level package `shipyard_runtime`; where its files ship is
stages/bundling/layout.py; the templates are rendered by stages/rendering; the harnesses
that start a bundle's servers locally sit beside the load test (stages/loadtesting)."""
