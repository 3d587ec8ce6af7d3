"""Where things live in a bundle, shared by the stages that write and point at them."""

from __future__ import annotations

# The single copy of the ONNX model in a bundle: Triton's version folder (Triton needs it
# there); serving.yaml and the MLServer settings point at the same file.
MODEL_DIR = "serving/triton/{release}/1"
