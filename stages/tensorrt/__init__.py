"""TensorRT: engine build, engine parity, CUDA-graph replay, the Triton TensorRT entry.
Imported only when a GPU and TensorRT are present (the engine stage checks first)."""
