"""What the CLI shows: tables, progress and one-line notes, built from the library's typed results. Rendering
only: nothing here decides anything."""

from __future__ import annotations

import contextlib
import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table

# Tables are wide: when writing to a file or pipe (logs, CI), do not cut them at 80 columns.
console = Console(stderr=True, width=None if sys.stderr.isatty() else 200)
out = Console(width=None if sys.stdout.isatty() else 200)


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def error(text: str) -> None:
    console.print(f"[bold red]error:[/] {escape(text)}", highlight=False, soft_wrap=True)


def note(text: str) -> None:
    console.print(f"[yellow]note:[/] {escape(text)}", highlight=False, soft_wrap=True)


def warning(text: str) -> None:
    console.print(f"[yellow]warning:[/] {escape(text)}", highlight=False, soft_wrap=True)


def _layers(entry) -> str:
    """TensorRT layers parsed, and of those the ones computed per inference (the rest fold at build)."""
    c = getattr(entry, "computed_layers", None)
    return f"{entry.layers} ({c})" if c is not None else str(entry.layers)


def table(title: str, columns, rows) -> Table:
    t = Table(title=title)
    for col in columns:
        t.add_column(col)
    for row in rows:
        t.add_row(*row)
    return t


@contextlib.contextmanager
def phases(names, with_bar: bool = False, total: int | None = None):
    """A progress row per component: rich's live display on a terminal, plain timestamped lines otherwise
    (logs and CI keep every phase, not a spinner's last frame). Yields update(component, phase)."""
    import time

    if not console.is_terminal:
        t0 = time.perf_counter()

        def plain(name, phase):
            console.print(f"[{time.perf_counter() - t0:7.1f}s] {name}: {phase}", highlight=False)

        yield plain
        return
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    cols = [SpinnerColumn(), TextColumn("{task.description:<12}"), *([BarColumn()] if with_bar else []),
            TextColumn("{task.fields[phase]}"), TimeElapsedColumn()]
    with Progress(*cols, console=console) as bar:
        tasks = {n: bar.add_task(n, phase="waiting", total=total) for n in names}
        steps = dict.fromkeys(names, 0)

        def update(name, phase):
            if name not in tasks:  # components appear as the build reaches them
                tasks[name], steps[name] = bar.add_task(name, phase=phase, total=total), 0
            steps[name] += 1
            bar.update(tasks[name], phase=phase, completed=steps[name] if with_bar else None)

        yield update


def export_summary(s) -> None:
    title = "zero-copy " if s.results and all(r.zero_copy for r in s.results) else ""
    rows = []
    for r in s.results:
        name = r.path.name + (" (+ .data)" if r.external_data else "")
        if r.zero_copy:
            name += f" -> {r.zero_copy['linked_tensors']} tensors, {human(r.zero_copy['linked_bytes'])} in the checkpoint"
            name += " (graph from cache)" if r.zero_copy["graph"] == "from cache" else ""
        err = f"{r.max_rel_err:.1e}" if r.max_rel_err is not None else "not validated"
        rows.append((r.component, name, r.dtype, human(r.bytes), f"{r.seconds:.1f}", err))
    out.print(table(f"ONNX {title}export of {s.source.id} ({s.source.variant}) -> {s.out_dir}",
                    ("component", "file", "dtype", "written", "seconds", "max rel err vs PyTorch"), rows))
    if s.zero_copy:
        out.print("zero-copy ONNX: its weights are links into the checkpoint; only fluxtrt and TensorRT's parser "
                  "read it (drop --zero-copy for standard ONNX)")
    if s.copied:
        out.print("weights copied, not zero-copy: " + "; ".join(s.copied))


STAGES = ("export", "optimize", "quantize", "build")


def build_summary(b) -> None:
    m, cfg = b.manifest, b.config
    packages = m.backend == "torch"  # compiled PyTorch engines: one stage, no layers
    kinds = ("package",) if packages else STAGES
    by = {(r.component, r.stage): r for r in b.results}
    rows = []
    for name in dict.fromkeys(r.component for r in b.results):
        e = m.components[name]
        stages = [by[(name, s)] for s in kinds if (name, s) in by]
        cells = {r.stage: f"{r.status} {r.seconds:.1f}s" if r.status == "built" else r.status for r in stages}
        rows.append((name, e.precision, *(cells.get(s, "-") for s in kinds), *(() if packages else (_layers(e),)),
                     human(e.bytes), f"{sum(r.seconds for r in stages):.1f}",
                     human(sum(r.bytes_written for r in stages)),
                     f"{max((r.peak_rss_mb for r in stages), default=0):.0f} MB"))
    what = (f"compiled PyTorch (AOTInductor, torch {m.backend_version}, CUDA {m.runtime['cuda']})" if packages
            else f"{m.backend} {m.backend_version}")
    out.print(table(f"{cfg.key}: {what} for {cfg.sm}, model {b.source.id} ({b.source.variant}) -> {b.gpu_dir}",
                    ("component", "precision", *kinds, *(() if packages else ("layers (computed)",)),
                     "package size" if packages else "engine size", "seconds", "bytes written", "peak RSS"), rows))
    for n in b.notes:
        note(n)
    if packages:
        out.print(f"run them with `fluxtrt run --engines {b.gpu_dir} ...` on this device with torch {m.backend_version}")
    else:
        out.print(memory_line(m))
    if b.up_to_date:
        out.print("Nothing to do: every engine is up to date (use --force to rebuild).")
    out.print(f"manifest: {b.gpu_dir / 'manifest.json'}; log: {b.gpu_dir / 'build.log'}")


def memory_line(m) -> str:
    """Device memory the engines need, from the builder's own report (see Manifest.memory_needed)."""
    full, low = m.memory_needed(), m.memory_needed(low_vram=True)
    if full is None:
        return "device memory needed: unknown (an engine lacks the builder's memory report: built by an older fluxtrt)"
    streamed = [n for n, e in m.components.items() if e.weight_streaming]
    tail = f"; {', '.join(streamed)} can stream weights (--weight-streaming-budget)" if streamed else ""
    return (f"device memory needed: {human(full)} with every engine resident, {human(low)} with --low-vram "
            f"(weights + one activation buffer for the profile's max shapes; opt-size requests reserve the same)"
            f"{tail}")


def timings(generated) -> None:
    rows = []
    for k, t in enumerate(generated.timings):
        st = t.steps or [0.0]
        mem = f"{t.peak_memory_gb:.2f}" if t.peak_memory_gb is not None else "-"
        cached = "-" if t.cache is None else f"{t.cache['computed']} / {t.cache['skipped']}"
        rows.append((str(k), f"{t.text_encoders:.3f}", f"{sum(st) / len(st):.3f}", f"{min(st):.3f}",
                     f"{max(st):.3f}", f"{t.vae:.3f}", f"{t.total:.3f}", mem, cached))
    out.print(table("timings (seconds)", ("call", "text encoders", "step mean", "step min", "step max",
                                          "VAE decode", "total", "peak GPU GB", "steps computed / skipped"), rows))
    for p in generated.paths:
        out.print(f"wrote {p}")


def bench_rows(rows, meta) -> None:
    def fmt(m):
        return f"{m.median:.3f} [{m.min:.3f}-{m.max:.3f}]"

    body = []
    for r in rows:
        speed = f"{r.ratios['end_to_end_s']:.2f}x (step {r.ratios['transformer_step_s']:.2f}x)" if r.ratios else ""
        if r.cache is not None:
            speed += f" cache {r.cache['threshold']:g}: {r.cache['computed']:g} computed, {r.cache['skipped']:g} skipped"
        body.append((r.system, f"{r.width}x{r.height}", str(r.batch), fmt(r.text_encoders_s),
                     fmt(r.transformer_step_s), fmt(r.vae_decode_s), fmt(r.end_to_end_s), f"{r.seconds_per_image:.3f}",
                     f"{r.images_per_minute:.1f}", f"{100 * r.outside_transformer_share:.1f}%",
                     "-" if r.peak_memory_gb is None else f"{r.peak_memory_gb:.1f}", speed))
    out.print(table(f"fluxtrt bench: {meta['variant']}, {meta['steps']} steps, {meta['runs']} runs (median "
                    "\\[min-max])", ("system", "size", "batch", "text enc s", "step s", "VAE s", "end-to-end s",
                                     "s/image", "img/min", "outside transformer", "peak GB",
                                     "speedup vs diffusers"), body))


def validate_rows(rows) -> None:
    body = []
    for r in rows:
        ref = (f"{r.reference:.1e}" if r.reference > 0 else "0 (identical)") + (" fp64" if r.reference_kind == "fp64" else "")
        body.append((r.component, r.precision, f"{r.batch}x{r.width}x{r.height}", f"{r.onnx_error:.1e}",
                     f"{r.onnx_mean_error:.1e}", ref, f"{r.ratio:.1f}" if r.reference > 0 else "-", f"{r.bound:.0e}",
                     r.against, ("[green]ok[/]" if r.ok else "[red]FAIL[/]") if r.decides
                     else "[dim]reported[/]"))
    out.print(table("ONNX Runtime vs PyTorch (max |diff| / max |ref|; reference: the module with SDPA's math "
                    "kernel vs its default, or marked fp64: the fp32 module vs itself in fp64)",
                    ("component", "graph", "batch x size", "error", "mean", "reference", "ratio", "bound", "against",
                     ""), body))


def inspection(m, checks) -> None:
    out.print(f"[bold]{escape(m.gpu_name)}[/] ({m.gpu}, {m.sm}) built by {m.backend} {m.backend_version}, fluxtrt "
              f"{m.fluxtrt}; model {escape(m.model.id)} ({m.model.variant}, {m.model.hash[:12]}); shapes "
              f"{m.shape_range}; workflows {', '.join(m.workflows)} ({m.model.model_class})")
    rows = []
    for c in checks:
        prof = ", ".join(f"{k} {v['min']}..{v['max']}" for k, v in c.entry.profile.items())
        rows.append((c.component, c.entry.precision, human(c.entry.bytes), _layers(c.entry), prof, c.file,
                     c.runtime))
    out.print(table("", ("component", "precision", "size", "layers (computed)", "inputs (min..max)", "file", "this machine"),
                    rows))
    if m.backend == "torch":  # compiled PyTorch packages: kernels in the .pt2, weights beside them
        weights = sum((e.constants or {}).get("bytes", 0) for e in m.components.values())
        out.print(f"compiled PyTorch packages for {m.runtime['target']} (torch {m.runtime['torch']}, CUDA "
                  f"{m.runtime['cuda']}); their weights: {human(weights)}, read to the device at load")
        split = next((e.parallel for e in m.components.values() if isinstance(e.parallel, dict)), None)
        if split:
            out.print(f"the transformer is compiled split over {split.get('ranks')} ranks ({split.get('attention')} "
                      f"attention): run with --parallel {split.get('ranks')}")
    else:
        out.print(memory_line(m))
    if any(c.file != "ok" for c in checks):
        warning("some engine files do not match the manifest (see the file column)")


def optimize_reports(reports, out_dir) -> None:
    for name, rep, check in reports:
        out.print(table(f"{name}: TensorRT layers {rep.trt_layers_before} -> {rep.trt_layers_after}; max rel err vs "
                        f"export {check.max_rel_err:.1e}", ("pass", "nodes before", "nodes after", "seconds"),
                        [(p, str(b), str(a), f"{sec:.2f}") for p, b, a, sec in rep.rows]))
    out.print(f"wrote {out_dir}")
