"""What the build stages and the runtime both stand on: the engine backends (TensorRT, TensorRT-RTX), refit,
ONNX Runtime sessions, weight maps and the workflow registry. Nothing here imports the stages or the runtime."""
