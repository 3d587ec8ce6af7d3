"""The runtime a Shipyard bundle ships: everything that runs where the model is served.

It imports nothing of the build (no `stages`, `schemas` or `pipelines`): only numpy,
onnxruntime, pydantic, prometheus_client, tokenizers and jinja2, plus mlserver for its
MLServer adapter and Triton's `triton_python_backend_utils` for its Triton one. The
repository's shipyard_runtime/README.md lists the modules and where each ships in a bundle.
"""
