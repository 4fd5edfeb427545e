"""The runtime: executors behind one interface (executors.py, tensorrt.py), the pipeline over them for every
workflow (pipeline.py: Pipeline), each workflow's start of the loop (workflows.py), the continuous batcher
(batching.py), backend choice (choice.py), LoRA (lora.py) and PNG writing (images.py). FLUX math is
fluxtrt/flux_math.py; the workflow declarations, backends, sessions and weight maps are fluxtrt/core/."""
