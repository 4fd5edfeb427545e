"""fluxtrt: FLUX.1 text-to-image models to TensorRT engines, and a thin runtime for them."""

__version__ = "0.1.0"
