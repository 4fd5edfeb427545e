"""The runtime: executors behind one interface (executors.py, tensorrt.py), the pipeline over them for every
workflow (pipeline.py: Pipeline), the continuous batcher (batching.py), backend choice (choice.py), LoRA
(lora.py) and PNG writing (images.py). FLUX math is fluxtrt/flux_math.py; workflows are fluxtrt/workflows/."""
