"""Model sources: local diffusers FLUX.1 folders and the embedded tiny models."""
