"""Small builders shared by tests."""

from fluxtrt.records import ComponentEntry


def entry(**fields) -> ComponentEntry:
    """A manifest entry with placeholder values for what a test does not look at."""
    base = dict(engine="x.engine", sha256="", bytes=1, precision="fp32", onnx="onnx/x.onnx", onnx_sha256="",
                build_key="", layers=1, inputs=[], outputs=[], profile={})
    return ComponentEntry(**{**base, **fields})
