"""Nothing from outside is trusted: a fuzz suite (hypothesis, bounded in examples) over every kind of input a user or
another machine hands fluxtrt — CLI options, HTTP bodies, manifests, weight maps, safetensors headers, archive
members and images — and one test per class of the hostile cases a probe found. Every generated case ends in success
or in one line and exit 2 (HTTP: 200 or a JSON 4xx); none leaves a traceback, writes outside --out or reads outside
the folders the user named."""

import copy
import io
import json
import math
import os
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image
from typer.testing import CliRunner

from fluxtrt.cli import app
from fluxtrt.errors import FluxtrtError

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.too_slow])


def one_line_exit_2(res):
    """The CLI's answer to bad input: exit 2, one `error:` line (or typer's own usage box), no traceback."""
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output, res.output
    errors = [ln for ln in res.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 or "Invalid value" in res.output or "No such option" in res.output, res.output


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


# -- a fake engine folder (manifest + model assets; no engine is built: checks need none) ------------------------
@pytest.fixture(scope="module")
def fake_folder(tmp_path_factory):
    from tests.helpers import fake_engine_folder

    folder = tmp_path_factory.mktemp("untrusted") / "4090"
    return folder, fake_engine_folder("tiny", folder, engine_files=True)


def with_manifest(folder: Path, manifest: dict, tmp: Path) -> Path:
    """A copy of the fake engine folder with another manifest."""
    import shutil

    dest = tmp / "4090"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(folder, dest, symlinks=True)
    (dest / "manifest.json").write_text(json.dumps(manifest))
    return dest


# -- class: paths from files we did not write stay in their folder ------------------------------------------------
ESCAPES = ["../../../etc/passwd", "/etc/passwd", "..", "a/../../x", "/etc/shadow", "", "\\\\server\\x"]


@pytest.mark.parametrize("field", ["engine", "onnx", "weight_map", "weightfree_onnx"])
@pytest.mark.parametrize("path", ESCAPES)
def test_manifest_paths_that_leave_the_folder_are_refused(fake_folder, tmp_path, field, path):
    folder, manifest = fake_folder
    m = copy.deepcopy(manifest)
    m["components"]["transformer"][field] = path
    bad = with_manifest(folder, m, tmp_path)
    for args in (["inspect", bad], ["run", "--engines", bad, "--prompt", "x", "--backend", "onnxruntime",
                                     "--out", tmp_path / "o.png"]):
        res = cli(*args)
        one_line_exit_2(res)
        assert "passwd" not in res.output or "leads outside" in res.output or "not a relative" in res.output
        assert not (tmp_path / "o.png").exists()


def test_a_link_out_of_the_folder_is_refused(fake_folder, tmp_path):
    folder, manifest = fake_folder
    bad = with_manifest(folder, manifest, tmp_path)
    (bad / "transformer.engine").unlink()
    (bad / "transformer.engine").symlink_to("/etc/passwd")
    res = cli("inspect", bad)
    one_line_exit_2(res)
    assert "leads outside" in res.output


def test_weight_map_subfolder_and_recipes_are_checked(tmp_path):
    from fluxtrt.core import weightmap
    from fluxtrt.fileio import inside

    with pytest.raises(FluxtrtError, match="leads outside"):
        inside(tmp_path, "../../etc", "the weight map's subfolder")
    good = {"refittable": True, "subfolder": "transformer", "reason": "", "weights": [
        {"name": "w", "shape": [2, 3], "dtype": "float32", "recipe": {"op": "transpose", "perm": [1, 0],
                                                                        "of": {"tensor": "k"}}}]}
    (tmp_path / "map.json").write_text(json.dumps(good))
    assert weightmap.read_map(tmp_path / "map.json")["weights"][0]["name"] == "w"
    for change in ({"recipe": {"op": "rm -rf", "of": {"tensor": "k"}}}, {"dtype": "object"}, {"shape": [-1]},
                   {"recipe": {"op": "reshape", "shape": "x", "of": {"tensor": "k"}}}):
        bad = copy.deepcopy(good)
        bad["weights"][0].update(change)
        (tmp_path / "map.json").write_text(json.dumps(bad))
        with pytest.raises(FluxtrtError):
            weightmap.read_map(tmp_path / "map.json")
    deep = {"tensor": "k"}
    for _ in range(40):
        deep = {"op": "cast", "to": "float32", "of": deep}
    bad = copy.deepcopy(good)
    bad["weights"][0]["recipe"] = deep
    (tmp_path / "map.json").write_text(json.dumps(bad))
    with pytest.raises(FluxtrtError, match="nested too deeply"):
        weightmap.read_map(tmp_path / "map.json")
    # a recipe that does not fit the checkpoint's tensor: one line, not numpy's traceback
    bad = copy.deepcopy(good)
    bad["weights"][0]["recipe"] = {"op": "transpose", "perm": [2, 0, 1], "of": {"tensor": "k"}}
    with pytest.raises(FluxtrtError, match="does not apply"):
        weightmap.materialize(bad, lambda key: np.random.default_rng().standard_normal((3, 2)).astype(np.float32))


JSONISH = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True) |
                       st.text(max_size=12) | st.sampled_from(ESCAPES),
                       lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3),
                       max_leaves=8)


@FUZZ
@given(data=st.data())
def test_fuzzed_manifests_inspect_cleanly(fake_folder, tmp_path_factory, data):
    """A manifest with any field replaced by any JSON value: inspect answers a table (exit 0) or one line (exit 2)."""
    folder, manifest = fake_folder
    m = copy.deepcopy(manifest)
    where = data.draw(st.sampled_from(["top", "component"]))
    target = m if where == "top" else m["components"][data.draw(st.sampled_from(sorted(m["components"])))]
    key = data.draw(st.sampled_from(sorted(target)))
    target[key] = data.draw(JSONISH)
    bad = with_manifest(folder, m, tmp_path_factory.mktemp("m"))
    res = cli("inspect", bad)
    if res.exit_code != 0:
        one_line_exit_2(res)


@pytest.mark.parametrize("target, text, says", [
    ("model/tokenizer/tokenizer.json", "{bad", "cannot load the tokenizers"),
    ("model/scheduler/scheduler_config.json", '{"shift": "x"}', "shift is 'x'"),
    ("model/scheduler/scheduler_config.json", '{"use_karras_sigmas": true}', "not supported"),
    ("model/scheduler/scheduler_config.json", "[1, 2]", "not a JSON object"),
    ("model/vae/config.json", "{}", "lacks"),
    ("model/transformer/config.json", '{"in_channels": -4}', "no FLUX.1 model has"),
    ("model/scheduler/scheduler_config.json", "[" * 100_000 + "]" * 100_000, "unreadable: not a model config (JSON)"),
    ("manifest.json", "[" * 100_000 + "]" * 100_000, "unreadable: not a fluxtrt manifest (JSON)"),
])
def test_configs_and_tokenizers_of_an_engine_folder_are_checked(fake_folder, tmp_path, target, text, says):
    folder, manifest = fake_folder
    bad = with_manifest(folder, manifest, tmp_path)
    (bad / target).write_text(text)
    res = cli("run", "--engines", bad, "--backend", "onnxruntime", "--prompt", "x", "--steps", "1",
              "--out", tmp_path / "o.png")
    one_line_exit_2(res)
    assert says in res.output and not (tmp_path / "o.png").exists(), res.output


def test_prompts_file_that_is_not_prompts(fake_folder, tmp_path):
    folder, _ = fake_folder
    for path, says in (("/dev/zero", "at most 16 MB"), (tmp_path / "none.txt", "no such file"), (tmp_path, "at most")):
        res = cli("run", "--engines", folder, "--prompts-file", path, "--out", tmp_path / "o.png")
        one_line_exit_2(res)
        assert says in res.output, res.output


@pytest.mark.parametrize("raw", [b"\xef\xbb\xbfa red fox\r\nthe sea\r\n", b"\xef\xbb\xbfa red fox\rthe sea\r",
                                 "a red fox\n\ufeffthe sea\n".encode()])
def test_prompts_file_encoding_marks_stay_out_of_the_prompts(tmp_path, raw):
    """A BOM and CR line ends (Windows editors) are the file's encoding: the prompts (which the PNGs record) are
    the text alone."""
    from fluxtrt.api import read_prompts

    (tmp_path / "p.txt").write_bytes(raw)
    assert read_prompts(None, tmp_path / "p.txt") == ["a red fox", "the sea"]


# -- class: safetensors headers ---------------------------------------------------------------------------------
def safetensors_bytes(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize("header, match", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, "share bytes"),
    ({"a": {"dtype": "F32", "shape": [2**31, 2**31], "data_offsets": [0, 16]}}, "needs"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [8, 0]}}, "data_offsets"),
    ({"a": {"dtype": "Q99", "shape": [4], "data_offsets": [0, 16]}}, "dtype"),
    ({"a": {"dtype": "F32", "shape": "4", "data_offsets": [0, 16]}}, "shape"),
    ({"a": [1, 2]}, "entry"),
])
def test_hostile_safetensors_headers_are_one_line(tmp_path, header, match):
    from fluxtrt.checkpoint import read_header

    f = tmp_path / "m.safetensors"
    f.write_bytes(safetensors_bytes(header, os.urandom(16)))
    with pytest.raises(FluxtrtError, match=match):
        read_header(f)


@FUZZ
@given(entries=st.dictionaries(st.text(min_size=1, max_size=6), st.fixed_dictionaries({
    "dtype": st.sampled_from(["F32", "BF16", "F16", "I64", "U8", "X"]),
    "shape": st.lists(st.integers(-1, 8), max_size=3),
    "data_offsets": st.lists(st.integers(-4, 80), min_size=2, max_size=2)}), max_size=4), tail=st.integers(0, 80))
def test_fuzzed_safetensors_headers(tmp_path_factory, entries, tail):
    """Any header: either every tensor lies inside the data, sized by its shape, none overlapping; or one line."""
    from fluxtrt.checkpoint import read_header

    f = tmp_path_factory.mktemp("st") / "m.safetensors"
    f.write_bytes(safetensors_bytes(entries, os.urandom(tail)))
    try:
        out = read_header(f)
    except FluxtrtError as e:
        assert "\n" not in str(e)
        return
    spans = sorted((t.offset, t.offset + t.length) for t in out.values() if t.length)
    assert all(b <= f.stat().st_size for _, b in spans)
    assert all(b0 >= a1 for (_, a1), (b0, _) in zip(spans, spans[1:]))
    assert all(t.length == math.prod(t.shape) * {"F32": 4, "BF16": 2, "F16": 2, "I64": 8, "U8": 1}[t.dtype]
               for t in out.values())


# -- class: archives ---------------------------------------------------------------------------------------------
def make_archive(tmp: Path, members) -> Path:
    """A .tar.gz of (name, type, bytes or claimed size) with a matching .sha256 beside it."""
    from fluxtrt.fileio import sha256_file

    path = tmp / "a.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, kind, payload in members:
            info = tarfile.TarInfo(name)
            info.type = kind
            if kind == tarfile.REGTYPE:
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
            else:
                info.linkname = "/etc/passwd"
                tar.addfile(info)
    (tmp / "a.tar.gz.sha256").write_text(f"{sha256_file(path)}  a.tar.gz\n")
    return path


def snapshot(folder: Path) -> set:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@pytest.mark.parametrize("members", [
    [(".", tarfile.DIRTYPE, b"")],
    [("4090/../../evil", tarfile.REGTYPE, b"x")],
    [("/abs", tarfile.REGTYPE, b"x")],
    [("4090/link", tarfile.SYMTYPE, b"")],
    [("4090/dev", tarfile.CHRTYPE, b"")],
    [("4090/a", tarfile.REGTYPE, b"x"), ("4090/a", tarfile.REGTYPE, b"y")],
    [("4090/manifest.json", tarfile.REGTYPE, b"{}")],
])
def test_hostile_archives_are_one_line_and_write_nothing(tmp_path, members):
    archive = make_archive(tmp_path, members)
    out = tmp_path / "out"
    out.mkdir()
    res = cli("unpack", archive, "--out", out)
    one_line_exit_2(res)
    assert snapshot(out) == set(), snapshot(out)


def test_archive_claiming_more_than_it_holds_and_out_a_file(tmp_path):
    archive = make_archive(tmp_path, [("4090/x", tarfile.REGTYPE, b"abc")])
    raw = bytearray(__import__("gzip").decompress(archive.read_bytes()))
    raw[124:136] = b"%011o\0" % (100 << 30)  # the member's size field: 100 GB (header checksum now wrong)
    import gzip
    import hashlib

    archive.write_bytes(gzip.compress(bytes(raw)))
    (tmp_path / "a.tar.gz.sha256").write_text(hashlib.sha256(archive.read_bytes()).hexdigest() + "  a.tar.gz\n")
    one_line_exit_2(cli("unpack", archive, "--out", tmp_path / "o"))
    (tmp_path / "file").write_text("mine")
    res = cli("unpack", archive, "--out", tmp_path / "file")
    one_line_exit_2(res)
    assert (tmp_path / "file").read_text() == "mine"


@FUZZ
@given(members=st.lists(st.tuples(
    st.one_of(st.sampled_from(["4090", "4090/", ".", "..", "4090/..", "/x", "4090/a", "4090/b/c", "4090/.",
                               "4090/manifest.json", "x:y", "4090/a\\b"]), st.text(min_size=1, max_size=8)),
    st.sampled_from([tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.FIFOTYPE]),
    st.binary(max_size=32)), min_size=1, max_size=5))
def test_fuzzed_archives(tmp_path_factory, members):
    tmp = tmp_path_factory.mktemp("tar")
    try:
        archive = make_archive(tmp, members)
    except (ValueError, UnicodeEncodeError):
        return  # tarfile itself cannot write such a member
    out = tmp / "out"
    out.mkdir()
    before = snapshot(tmp)
    res = cli("unpack", archive, "--out", out)
    one_line_exit_2(res)  # none of these is a fluxtrt archive (no engines matching a manifest)
    assert snapshot(tmp) == before  # nothing written anywhere, --out included


# -- class: images ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,options", [("PNG", {}), ("TIFF", {"compression": "group4"})])
def test_a_decompression_bomb_gets_the_pixel_limit_line_in_every_format(tmp_path, fmt, options):
    """20000x20000 px (400 MP): Pillow refuses it while opening, before fluxtrt reads the size; the line is the
    same pixel-limit line as for a 65 MP image."""
    from fluxtrt.core.image_inputs import WorkflowError, load_image

    path = tmp_path / f"huge.{fmt.lower()}"
    Image.new("1", (20000, 20000)).save(path, fmt, **options)
    with pytest.raises(WorkflowError, match="is over the 64 MP limit; pass an image of at most a few megapixels"):
        load_image(path, "--image")


def test_exif_orientation_is_applied_as_diffusers_does(tmp_path):
    """A phone photo stored sideways with EXIF orientation 6: the image used is the upright one, as diffusers'
    load_image gives (exif_transpose), pixel for pixel."""
    from diffusers.utils import load_image as diffusers_load_image

    from fluxtrt.core.image_inputs import load_image

    rng = np.random.default_rng()
    stored = rng.integers(0, 256, (48, 80, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
    Image.fromarray(stored).save(tmp_path / "phone.jpg", exif=exif.tobytes(), quality=95)
    ours = load_image(tmp_path / "phone.jpg", "--image")
    theirs = diffusers_load_image(str(tmp_path / "phone.jpg"))
    assert ours.size == (48, 80) == theirs.size
    assert np.array_equal(np.asarray(ours), np.asarray(theirs))


@FUZZ
@given(mode=st.sampled_from(["1", "L", "P", "RGB", "RGBA", "I", "I;16", "F", "LA", "CMYK"]),
       w=st.integers(1, 40), h=st.integers(1, 40), fmt=st.sampled_from(["PNG", "TIFF", "BMP", "JPEG"]),
       cut=st.integers(0, 400))
def test_fuzzed_images(tmp_path_factory, mode, w, h, fmt, cut):
    """Any image, truncated or not: an 8-bit RGB image of its size, or one line."""
    from fluxtrt.core.image_inputs import WorkflowError, load_image

    buf = io.BytesIO()
    try:
        Image.new(mode, (w, h)).save(buf, format=fmt)
    except (OSError, KeyError, ValueError):
        return  # this format cannot store this mode
    f = tmp_path_factory.mktemp("img") / "x.img"
    raw = buf.getvalue()
    f.write_bytes(raw[:len(raw) - cut] if cut < len(raw) else raw[:3])
    try:
        img = load_image(f, "--image")
    except WorkflowError as e:
        assert "\n" not in str(e)
        return
    assert img.mode == "RGB" and img.size == (w, h) and min(w, h) >= 16


# -- class: outputs never replace inputs -------------------------------------------------------------------------
def test_out_never_replaces_an_input_or_a_folder(fake_folder, tmp_path):
    folder, _ = fake_folder
    img = tmp_path / "in.png"
    Image.new("RGB", (64, 64), (10, 20, 30)).save(img)
    before = img.read_bytes()
    base = ["run", "--engines", folder, "--backend", "onnxruntime", "--prompt", "x"]
    for extra in (["--image", img, "--out", img], ["--image", img, "--out", tmp_path / "." / "in.png"],
                  ["--out", folder / "x.png"], ["--out", tmp_path]):
        res = cli(*base, *extra)
        one_line_exit_2(res)
    assert img.read_bytes() == before
    one_line_exit_2(cli("export", "--out", img, "--model", "tiny"))
    assert img.read_bytes() == before


def test_a_failed_build_leaves_no_new_gpu_folder(tmp_path, monkeypatch):
    import fluxtrt.stages.build as stages_build

    def fail(*a, **k):
        raise FluxtrtError("simulated failure while exporting")

    monkeypatch.setattr(stages_build, "ensure_onnx", fail)
    res = cli("build", "--gpu", "4090", "--model", "tiny", "--out", tmp_path / "out", "-c", "clip")
    one_line_exit_2(res)
    assert not (tmp_path / "out" / "4090").exists(), snapshot(tmp_path / "out")


# -- class: numeric options, duplicates, serve's own options --------------------------------------------------------
@pytest.mark.parametrize("args", [
    ["--guidance", "-1e30"], ["--guidance", "nan"], ["--true-cfg", "nan"], ["--true-cfg", "inf"],
    ["--lora", "x.safetensors:inf"], ["--strength", "nan"], ["--height", "999999"], ["--max-area", "-5"],
    ["--fallback", "t5,t5"],
])
def test_run_numbers_out_of_range_are_one_line(fake_folder, tmp_path, args):
    folder, _ = fake_folder
    res = cli("run", "--engines", folder, "--backend", "onnxruntime", "--prompt", "x", "--out", tmp_path / "o.png",
              *args)
    one_line_exit_2(res)


@pytest.mark.parametrize("args, says", [
    (["export", "--opset", "1"], "--opset"), (["export", "--opset", "99"], "--opset"),
    (["build", "--gpu", "4090", "-p", "transformer=fp8,transformer=bf16"], "given twice"),
    (["build", "--gpu", "4090", "-p", "fp8", "-p", "bf16"], "given twice"),
    (["build", "--gpu", "4090", "-c", "clip,clip"], "given twice"), (["calibrate", "--resolution", "7"], "--resolution"),
    (["serve", "--engines", "E", "--port", "99999"], "--port"), (["serve", "--engines", "E", "--max-batch", "0"],
                                                                  "--max-batch"),
    (["serve", "--engines", "E", "--max-queue", "-1"], "--max-queue"),
    (["serve", "--engines", "E", "--host", "no such host !"], "--host"),
])
def test_options_are_checked_before_any_work(tmp_path, args, says):
    pytest.importorskip("ray")
    res = cli(*[a if a != "E" else tmp_path for a in args], *(["--out", tmp_path / "o"] if args[0] in (
        "export", "build", "calibrate") else []))
    one_line_exit_2(res)
    assert says in res.output and not (tmp_path / "o").exists()


def test_serve_refuses_a_port_in_use(fake_folder):
    import socket

    pytest.importorskip("ray")
    folder, _ = fake_folder
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        res = cli("serve", "--engines", folder, "--port", s.getsockname()[1], "--backend", "onnxruntime")
    one_line_exit_2(res)
    assert "another program" in res.output


# -- class: HTTP bodies -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body, status", [
    (b'{"prompt": "a", "size": "\xef\xbc\x95\xef\xbc\x91\xef\xbc\x92x512"}', 400),  # fullwidth digits
    (b"[" * 100_000 + b"]" * 100_000, 413), (b"[" * 5000 + b"]" * 5000, 400),
    (b'{"prompt": "' + b"a" * (1 << 20) + b'"}', 413), (b"\xff\xfe", 400), (b'{"prompt": "a", "size": 512}', 400),
])
def test_hostile_http_bodies_get_a_json_4xx(body, status):
    from fluxtrt.serving import BadRequest, parse_request

    with pytest.raises(BadRequest) as e:
        parse_request(body, (512, 512), 28)
    assert e.value.status == status and "\n" not in str(e.value)


@FUZZ
@given(body=st.one_of(st.binary(max_size=200), JSONISH.map(lambda v: json.dumps(v).encode()),
                      st.fixed_dictionaries({"prompt": st.text(max_size=20)}, optional={
                          "size": JSONISH | st.from_regex(r"[0-9０-９]{1,4}[xX×][0-9]{1,4}", fullmatch=True),
                          "n": JSONISH, "steps": JSONISH, "guidance": JSONISH, "seed": JSONISH,
                          "response_format": JSONISH}).map(lambda d: json.dumps(d).encode())))
def test_fuzzed_http_bodies(body):
    """Any body parses to a request whose numbers are in range, or is refused with a one-line 4xx."""
    from fluxtrt.serving import MAX_N, BadRequest, parse_request

    try:
        req = parse_request(body, (512, 512), 28)
    except BadRequest as e:
        assert 400 <= e.status < 500 and "\n" not in str(e)
        return
    assert 1 <= req.n <= MAX_N and 1 <= req.steps <= 1000 and math.isfinite(req.guidance) and req.width > 0


@FUZZ
@given(extra=st.dictionaries(st.text(min_size=1, max_size=12), JSONISH, max_size=3))
def test_fuzzed_http_field_names(extra):
    """A field the API does not take is refused with a 400 naming it ("stpes" once ran 28 steps with seed 0);
    a body of known fields only is read."""
    from fluxtrt.serving import FIELDS, BadRequest, parse_request

    body = json.dumps({"prompt": "a fox", **extra}).encode()
    unknown = [k for k in {"prompt": 0, **extra} if k not in FIELDS]
    try:
        parse_request(body, (512, 512), 28)
    except BadRequest as e:
        assert e.status == 400 and "\n" not in str(e)
        assert not unknown or str(e).startswith(f"unknown field {json.dumps(unknown[0][:40])}"), (unknown, str(e))
        return
    assert not unknown


# -- class: CLI options of run ---------------------------------------------------------------------------------------
@FUZZ
@given(guidance=st.floats(allow_nan=True, allow_infinity=True), true_cfg=st.floats(allow_nan=True),
       strength=st.floats(allow_nan=True), lora_scale=st.floats(allow_nan=True))
def test_fuzzed_run_floats(fake_folder, tmp_path_factory, guidance, true_cfg, strength, lora_scale):
    folder, _ = fake_folder
    out = tmp_path_factory.mktemp("o") / "o.png"
    res = cli("run", "--engines", folder, "--backend", "onnxruntime", "--prompt", "x", "--out", out,
              "--guidance", guidance, "--true-cfg", true_cfg, "--negative-prompt", "", "--strength", strength,
              "--lora", f"x.safetensors:{lora_scale}", "--steps", "0")  # steps 0: nothing valid would run
    one_line_exit_2(res)
    assert not out.exists()


def test_help_reads_cleanly_at_80_and_120_columns():
    for cols in ("80", "120"):
        for cmd in ([], ["run"], ["build"], ["serve"], ["inspect"]):
            res = CliRunner().invoke(app, [*cmd, "--help"], env={"COLUMNS": cols}, terminal_width=int(cols))
            assert res.exit_code == 0 and "<bool>" not in res.output, res.output
            assert all(len(line) <= int(cols) for line in res.output.splitlines())
    res = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "80"})
    rows = [ln for ln in res.output.splitlines() if ln.startswith("│ ")]
    # a command's description is one paragraph: no row of it ends short while the next row continues it
    desc = [ln[13:-1].rstrip() for ln in rows]
    assert not any(len(a) < 40 and b and not b.startswith(" ") and a and a[-1] not in ".)" for a, b in
                   zip(desc, desc[1:]) if a.strip()), res.output


# -- class: an output folder holding another model's engines -------------------------------------------------------
def test_a_build_of_another_model_never_replaces_the_engines_there(fake_folder, tmp_path):
    """`build --model tiny-schnell` into a root whose 4090/ holds tiny's engines is refused in one line before any
    work, and tiny's manifest and engines stay as they were."""
    import shutil

    folder, _ = fake_folder
    root = tmp_path / "root"
    shutil.copytree(folder, root / "4090", symlinks=True)
    before = snapshot(root)
    hashes = {p: p.read_bytes() for p in (root / "4090").glob("*.engine")}
    res = cli("build", "--gpu", "4090", "--model", "tiny-schnell", "--out", root, "-c", "clip")
    one_line_exit_2(res)
    assert "holds engines of tiny, not tiny-schnell: pass another --out" in res.output
    assert snapshot(root) == before and all(p.read_bytes() == b for p, b in hashes.items())


# -- class: broken ONNX files handed to `fluxtrt optimize` -----------------------------------------------------------
@pytest.fixture(scope="module")
def clip_export(tmp_path_factory):
    from fluxtrt import api

    out = tmp_path_factory.mktemp("export-clip") / "onnx"
    api.export("tiny", out, ["clip"], validate=False)
    return out


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage", "missing"])
def test_optimize_on_a_broken_onnx_is_one_line_and_writes_nothing(clip_export, tmp_path, damage):
    import shutil

    src = tmp_path / "in"
    shutil.copytree(clip_export, src)
    onnx_file = src / "clip.onnx"
    data = onnx_file.read_bytes()
    if damage == "missing":
        onnx_file.unlink()
    else:
        onnx_file.write_bytes({"empty": b"", "truncated": data[: len(data) // 3],
                               "garbage": os.urandom(len(data))}[damage])
    res = cli("optimize", "--in", src, "--out", tmp_path / "out", "-c", "clip")
    one_line_exit_2(res)
    assert "is not the ONNX that export.json records" in res.output and "nothing was written" in res.output
    assert not (tmp_path / "out").exists()


# -- class: an edited manifest, a truncated weight map ---------------------------------------------------------------
@pytest.mark.parametrize("edit,says", [
    (lambda m: m["model"].update(id="tiny-fill"), "names the model 'tiny-fill', whose engines are a dev FluxFillPipeline"),
    (lambda m: m["model"].update(id="tiny-schnell", variant="schnell"), "the manifest's model is a schnell FluxPipeline"),
    (lambda m: m["model"].update(model_class="FluxFillPipeline"), "model assets are a dev FluxPipeline"),
    (lambda m: m.update(workflows=["txt2img", "fill"]), "are not what a FluxPipeline serves"),
])
def test_an_edited_model_in_the_manifest_is_caught_by_inspect_and_run(fake_folder, tmp_path, edit, says):
    folder, manifest = fake_folder
    changed = copy.deepcopy(manifest)
    edit(changed)
    dest = with_manifest(folder, changed, tmp_path)
    for args in (["inspect", dest], ["run", "--engines", dest, "--prompt", "a fox", "--backend", "onnxruntime",
                                     "--out", tmp_path / "x.png"]):
        res = cli(*args)
        one_line_exit_2(res)
        assert says in " ".join(res.output.split()), res.output
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("damage", ["truncated", "empty", "not a map"])
def test_inspect_reads_every_weight_map(fake_folder, tmp_path, damage):
    folder, manifest = fake_folder
    dest = with_manifest(folder, manifest, tmp_path)
    path = dest / "t5.weights.json"
    text = path.read_text()
    path.write_text({"truncated": text[: len(text) // 2], "empty": "", "not a map": "[1, 2]"}[damage])
    res = cli("inspect", dest)
    one_line_exit_2(res)
    assert "t5.weights.json" in " ".join(res.output.split()) and "rebuild the engines" in res.output
