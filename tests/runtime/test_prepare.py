"""runtime/prepare.py: each workflow's start of the denoising loop, one function per declared workflow."""

from fluxtrt.core.workflows import WORKFLOWS


def test_every_declared_workflow_has_its_runtime_preparation():
    """core/workflows.py declares, runtime/prepare.py prepares: one function per workflow, by name."""
    from fluxtrt.runtime.prepare import PREPARE

    assert set(PREPARE) == set(WORKFLOWS) and len(WORKFLOWS) == 5
    assert all(PREPARE[name].__name__ == name for name in WORKFLOWS)
