"""ONNX and the PyTorch model behind it: loading checkpoints, the graph's input/output
layout, the shapes every stage probes at, graph inspection, and the one comparator."""
