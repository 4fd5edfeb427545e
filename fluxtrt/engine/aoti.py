"""Compile one component's PyTorch module into a compiled PyTorch engine: an AOTInductor package (`.pt2`).

`torch.export` traces the module over the spec's inputs with the profile's ranges as dynamic dimensions (a
static profile gives static shapes), then Inductor compiles it ahead of time for this machine's device: C++ on a
CPU, Triton kernels on a CUDA GPU. The package holds the kernels; the weights (as the module holds them: an fp8
recipe's E4M3 weights stay E4M3) go to a safetensors file beside it. It is tied to the torch version and the
device it was compiled on (`core/packages.py`), which the manifest records and the runtime checks before loading
it."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ..components import ComponentSpec, Geometry, ShapePoint, ShapeRange
from ..errors import BuildError


@dataclass
class BuiltPackage:
    bytes: int
    sha256: str
    inputs: list[dict]  # {"name", "dtype" (the manifest's engine I/O names: float, bf16, int64, ...), "shape"}
    outputs: list[dict]
    profile: dict  # input name -> {"min": [...], "opt": [...], "max": [...]}
    constants: dict  # the weights file beside the package: {"file", "tree_sha256", "bytes"} (core/packages.py)
    export_seconds: float
    compile_seconds: float


def example_point(rng: ShapeRange) -> ShapePoint:
    """The shape torch.export traces at: the profile's opt with batch 2 where the profile allows it (a traced size
    of 1 would be specialized and lose the dynamic batch)."""
    opt = rng.opt
    batch = 2 if rng.min.batch <= 2 <= rng.max.batch and rng.min.batch != rng.max.batch else opt.batch
    return ShapePoint(batch, opt.height, opt.width, opt.reference)


def dynamic_shapes(spec: ComponentSpec, geo: Geometry, rng: ShapeRange) -> tuple:
    """torch.export's dynamic_shapes for the spec's inputs: one Dim per symbol the profile varies, shared by every
    input that names it (the transformer's tokens in hidden_states and img_ids)."""
    import torch

    profile = spec.profile(rng, geo)
    dims, out = {}, []
    for t in spec.inputs:
        lo, _, hi = profile[t.name]
        axes = {}
        for i, symbol in t.symbolic_axes().items():
            if lo[i] == hi[i]:
                continue
            if symbol not in dims:  # pixel sizes are latent sizes times the VAE's factor (its convolutions rely on it)
                m = geo.vae_scale_factor if symbol in ("image_height", "image_width") else 1
                dims[symbol] = m * torch.export.Dim(symbol, min=lo[i] // m, max=hi[i] // m) if m > 1 else \
                    torch.export.Dim(symbol, min=lo[i], max=hi[i])
            axes[i] = dims[symbol]
        out.append(axes or None)
    return tuple(out)


def _io(spec_tensors, tensors) -> list[dict]:
    from ..dtypes import TABLE

    names = {d.numpy: d.tensorrt for d in TABLE}
    return [{"name": t.name, "dtype": names[str(v.dtype).removeprefix("torch.")], "shape": list(t.dims)}
            for t, v in zip(spec_tensors, tensors)]


def compile_package(module, spec: ComponentSpec, geo: Geometry, rng: ShapeRange, *, device, dtype,
                    package_path: Path, share=None) -> BuiltPackage:
    """Export `module` (the spec's wrapped module, on `device` in `dtype`) over the profile and compile it into
    `package_path` (the kernels, written under a temp name and renamed) and its weights into
    `<component>.constants.safetensors` beside it. `share(feeds)`: what one rank computes of the whole inputs (a
    package split over ranks, traced at that share). Raises BuildError naming the component where torch.export or
    Inductor fails."""
    import torch

    from ..core.packages import CONSTANTS, save_constants
    from ..fileio import atomic_path, check_space, sha256_file

    point = example_point(rng)
    feeds = spec.sample_inputs(point, geo, seed=0)
    feeds = share(feeds) if share is not None else feeds
    args = tuple(feeds[t.name].to(device, dtype) if feeds[t.name].is_floating_point() else feeds[t.name].to(device)
                 for t in spec.inputs)
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            exported = torch.export.export(module, args, dynamic_shapes=dynamic_shapes(spec, geo, rng), strict=False)
        outputs = traced_outputs(exported)
    except Exception as e:  # torch.export's errors are pages long: the first line names the problem
        raise BuildError(f"{spec.name}: torch.export failed ({type(e).__name__}: {str(e).strip().splitlines()[0][:300]})"
                         "; build the ONNX path instead (drop --backend torch)") from e
    export_seconds = time.perf_counter() - t0
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    package_path = Path(package_path)
    check_space(package_path, sum(p.numel() * p.element_size() for p in module.state_dict().values()))
    t0 = time.perf_counter()
    try:
        with atomic_path(package_path) as tmp, _lowered_graphs() as graphs:
            torch._inductor.aoti_compile_and_package(exported, package_path=str(tmp),
                                                     inductor_configs={"aot_inductor.package_constants_in_so": False,
                                                                       # no constants made at compile time: the
                                                                       # weights file holds every one the
                                                                       # package reads (the fp8 transformer's
                                                                       # folded ones were missing on the H200)
                                                                       "joint_graph_constant_folding": False,
                                                                       "cpp.cxx": (None, cxx_compiler()[0])})
    except Exception as e:
        raise BuildError(f"{spec.name}: AOTInductor failed to compile the package ({type(e).__name__}: "
                         f"{str(e).strip().splitlines()[0][:300] if str(e).strip() else ''})") from e
    compile_seconds = time.perf_counter() - t0
    weights = {**exported.state_dict, **exported.constants}
    made = made_constants(graphs, weights)
    constants = save_constants({**weights, **made}, package_path.with_name(spec.name + CONSTANTS))
    constants["made_by_inductor"] = len(made)
    profile = {name: {"min": list(lo), "opt": list(opt), "max": list(hi)}
               for name, (lo, opt, hi) in spec.profile(rng, geo).items()}
    return BuiltPackage(bytes=package_path.stat().st_size, sha256=sha256_file(package_path),
                        inputs=_io(spec.inputs, args), outputs=_io(spec.outputs, outputs), profile=profile,
                        constants=constants,
                        export_seconds=round(export_seconds, 3), compile_seconds=round(compile_seconds, 3))


def traced_outputs(exported) -> list:
    """The module's outputs as torch.export traced them (fake tensors: dtype and shape, nothing computed; a split
    package's attention could not run here, outside its ranks)."""
    from torch.export.graph_signature import OutputKind

    values = {n.name: n.meta.get("val") for n in exported.graph.nodes}
    return [values[s.arg.name] for s in exported.graph_signature.output_specs if s.kind == OutputKind.USER_OUTPUT]


@contextlib.contextmanager
def _lowered_graphs():
    """The Inductor graphs an AOT compile lowers, as it lowers them (their constants, read after)."""
    from torch._inductor.graph import GraphLowering

    graphs, codegen = [], GraphLowering.codegen_with_cpp_wrapper

    def recorded(self, *args, **kwargs):
        graphs.append(self)
        return codegen(self, *args, **kwargs)

    GraphLowering.codegen_with_cpp_wrapper = recorded
    try:
        yield graphs
    finally:
        GraphLowering.codegen_with_cpp_wrapper = codegen


def made_constants(graphs, weights: dict) -> dict:
    """The constants a package reads that the exported program does not hold ({name the package asks for:
    tensor}): Inductor makes some while lowering (named `constantN`; the fp8 transformer's package on the H100 asked
    for `constant1235`, not in its weights file). The package names a constant by its original FQN where it has one
    (as the C++ wrapper's constants_info_ does), else by Inductor's name."""
    made = {}
    for g in graphs:
        for name, tensor in g.constants.items():
            fqn = g.dynamo_flat_name_to_original_fqn.get(name) or g.allocated_constant_name.get(name, name)
            if fqn not in weights and fqn not in made:
                made[fqn] = tensor
    return made


def cxx_compiler() -> tuple[str, str]:
    """The C++ compiler a package's wrapper is compiled with, and the version of the shared libstdc++ it links. The
    wrapper must link the libstdc++ the loading process runs on: the H200 image's $CXX=/opt/gcc/bin/g++ links
    libstdc++ statically (its libstdc++.so is missing) and every package it made SIGSEGVed on load in std::regex,
    where /usr/bin/g++ 13.3 made them load (scripts/aoti_probe.py --toolchain, docs/bench/aot_engines.json).
    $CXX or g++ when it links this process's libstdc++; else the first compiler here that does; else the first that
    links an older one. BuildError naming each compiler when none fits."""
    return _choose_compiler(tuple(dict.fromkeys(c for c in (os.environ.get("CXX"), "g++", "c++", "/usr/bin/g++") if c)))


@functools.cache
def _choose_compiler(candidates: tuple[str, ...]) -> tuple[str, str]:
    from ..core.packages import _version, libstdcxx_version, loaded_libstdcxx

    here = loaded_libstdcxx()
    found = []
    for cxx in candidates:
        if not shutil.which(cxx):
            continue
        try:  # what `-lstdc++` links: a shared libstdc++, or (a bare name back) the static archive
            out = subprocess.run([cxx, "-print-file-name=libstdc++.so"], capture_output=True, text=True,
                                 timeout=60).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            continue
        version = libstdcxx_version(out) if os.path.isabs(out) and os.path.exists(out) else None
        found.append((cxx, version))
        if version and (here is None or version == here):
            return cxx, version
    older = [(c, v) for c, v in found if v and _version(v) < _version(here)]
    if older:
        return older[0]
    if not found:
        raise BuildError(f"no C++ compiler here ({', '.join(candidates)}): AOTInductor compiles packages with one; "
                         "install g++ or set CXX")
    names = "; ".join(f"{c} links libstdc++ {v}" if v else f"{c} links libstdc++ statically" for c, v in found)
    raise BuildError(f"no C++ compiler here makes packages this torch can load: {names}, and this process runs on "
                     f"libstdc++ {here} (a package linked to another crashes on load); set CXX to a g++ that links "
                     f"libstdc++ {here} or older as a shared library")


def check_target(compute_capability: str) -> str:
    """The device a package for `compute_capability` is compiled on here ("cpu" or "cuda"): Inductor compiles for
    the device it runs on, so a GPU target needs that GPU in this machine. ConfigError otherwise."""
    from ..core.backends import local_gpu_capabilities
    from ..errors import ConfigError

    if compute_capability == "cpu":
        return "cpu"
    have = local_gpu_capabilities()
    if compute_capability not in have:
        here = f"this machine has {', '.join('sm' + c.replace('.', '') for c in have)}" if have else "this machine has none"
        raise ConfigError(f"compiled PyTorch engines for sm{compute_capability.replace('.', '')} are compiled on that "
                          f"GPU ({here}): build on a machine with it, or --gpu cpu")
    return "cuda"
