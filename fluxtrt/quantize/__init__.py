"""Quantize stage: calibration (with an on-disk cache) and explicit Q/DQ insertion for FP8 / INT8 / INT4."""
