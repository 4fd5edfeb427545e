"""The FLUX.1 workflows fluxtrt runs, one file each: text-to-image, img2img, Fill, Control (Canny / Depth),
Kontext. A model folder's `model_index.json` class says which it serves; the request's flags pick among them."""

from __future__ import annotations

from ..components import Geometry
from .base import Context, ImageInputs, Prepared, Workflow, WorkflowError
from .control import Control
from .fill import Fill
from .img2img import ImageToImage
from .kontext import Kontext
from .txt2img import TextToImage

WORKFLOWS: dict[str, Workflow] = {w.name: w for w in (TextToImage(), ImageToImage(), Fill(), Control(), Kontext())}
MODEL_CLASSES = tuple(dict.fromkeys(w.model_class for w in WORKFLOWS.values()))

__all__ = ["WORKFLOWS", "Context", "ImageInputs", "Prepared", "Workflow", "WorkflowError", "for_model", "select",
           "check_model", "profile_range"]


def for_model(geo: Geometry) -> list[Workflow]:
    """The workflows a model serves (from its model_index.json class)."""
    found = [w for w in WORKFLOWS.values() if w.model_class == geo.pipeline]
    if not found:
        raise WorkflowError(f"the model's model_index.json names {geo.pipeline}; fluxtrt runs "
                            f"{', '.join(MODEL_CLASSES)} models")
    return found


def check_model(geo: Geometry) -> None:
    """The model's class and its transformer's in_channels agree (e.g. Fill-dev: 64 + 64 + 256 = 384)."""
    wf = for_model(geo)[0]
    want = geo.packed_channels + wf.extra_channels(geo.latent_channels, geo.vae_scale_factor)
    if geo.in_channels != want or geo.out_channels != geo.packed_channels:
        raise WorkflowError(f"a {geo.pipeline} model's transformer takes {want} channels and predicts "
                            f"{geo.packed_channels}; this one has in_channels {geo.in_channels}, out_channels "
                            f"{geo.out_channels}: check the model folder")


def select(geo: Geometry, inputs: ImageInputs) -> Workflow:
    """The workflow for a request: the model's one that takes exactly the given flags. Otherwise one line
    naming the flag and the model that would serve it."""
    given = set(inputs.given())
    served = for_model(geo)
    for wf in sorted(served, key=lambda w: -len(w.required)):
        if set(wf.required) <= given and given <= set(wf.flags):
            wf.check(inputs)
            return wf
    names = ", ".join(w.name for w in served)
    model = served[0].model_name
    for flag in sorted(given):
        if not any(flag in w.flags for w in served):
            other = next((w for w in WORKFLOWS.values() if flag in w.flags), None)
            need = f"; it needs a {other.model_name} model ({other.name})" if other else ""
            raise WorkflowError(f"{flag} cannot be used with these engines: they are {model} ({names}){need}")
    wf = next(w for w in served if given <= set(w.flags))
    missing = [f for f in wf.required if f not in given]
    raise WorkflowError(f"{model} ({wf.name}) needs {' and '.join(missing)}: pass "
                        f"{' '.join(f'{f} FILE.png' for f in missing)}")


def profile_range(geo: Geometry, name: str, rng):
    """One component's profile: the config's request sizes as the model's workflows widen them (the workflows
    of one model share its engines; text-to-image and img2img widen nothing)."""
    return for_model(geo)[-1].component_range(name, rng)
