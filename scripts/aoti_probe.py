"""Where does loading an AOTInductor package crash on this GPU? Each case in its own process (a segfault ends only
that case): a toy bf16 module with its weights inside the .so, the same with them outside (user-managed or copied
constants), and fp8 (torch._scaled_mm). Prints one line per case and step.
Run:  python3 scripts/aoti_probe.py [--device cuda] [--out DIR]"""

import argparse
import subprocess
import sys
import tempfile
import time

CASE = r'''
import faulthandler, sys, time, torch
faulthandler.enable()
case, device, folder = sys.argv[1], sys.argv[2], sys.argv[3]
t = time.perf_counter()
def say(what):
    print(f"{case} {what} {time.perf_counter() - t:.1f}s", flush=True)

class Toy(torch.nn.Module):
    def __init__(self, fp8):
        super().__init__()
        self.fp8 = fp8
        self.a, self.b = torch.nn.Linear(256, 512), torch.nn.Linear(512, 256)
        if fp8:
            self.register_buffer("wq", torch.randn(512, 256).to(torch.float8_e4m3fn))
            self.register_buffer("sw", torch.tensor(0.01))
    def forward(self, x):
        h = torch.nn.functional.gelu(self.a(x))
        if self.fp8:
            q = (x / 0.05).clamp(-448, 448).to(torch.float8_e4m3fn)
            h = h + torch._scaled_mm(q, self.wq.t(), scale_a=torch.tensor(0.05, device=x.device), scale_b=self.sw,
                                     out_dtype=torch.bfloat16)
        return self.b(h)

fp8, inside = "fp8" in case, "inside" in case
dtype = torch.bfloat16 if device == "cuda" else torch.float32
m = Toy(fp8).to(device, dtype if not fp8 else None).eval()
if fp8:
    m.a.to(torch.bfloat16); m.b.to(torch.bfloat16)
x = torch.randn(64, 256, device=device, dtype=dtype)
with torch.no_grad():
    ref = m(x)
ep = torch.export.export(m, (x,), strict=False)
path = torch._inductor.aoti_compile_and_package(ep, package_path=f"{folder}/{case}.pt2",
                                                inductor_configs={"aot_inductor.package_constants_in_so": inside})
say("compiled")
fn = torch._inductor.aoti_load_package(path)
say("loaded")
if not inside:
    consts = {k: v.detach().clone() for k, v in m.state_dict().items()}
    names = fn.get_constant_fqns()
    say(f"fqns {names}")
    fn.load_constants({k: consts[k] for k in names}, check_full_update=True, user_managed="copy" not in case)
    say("constants")
out = fn(x)
say(f"ran, max abs diff {(out.float() - ref.float()).abs().max().item():.3g}")
'''


LOAD = r'''
import faulthandler, sys, time, zipfile, torch
faulthandler.enable()
how, path, folder = sys.argv[1], sys.argv[2], sys.argv[3]
x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
if how == "default":
    fn = torch._inductor.aoti_load_package(path)
elif how == "single":
    fn = torch._inductor.aoti_load_package(path, run_single_threaded=True)
elif how == "runner":  # the .so out of the archive, run by the container runner without the package loader
    with zipfile.ZipFile(path) as z:
        z.extractall(folder + "/x")
        names = z.namelist()
    so = next(n for n in names if n.endswith(".so"))
    print("members", [n for n in names if not n.endswith((".cubin", ".fatbin"))][:12], flush=True)
    import os
    runner = torch._C._aoti.AOTIModelContainerRunnerCuda(f"{folder}/x/{so}", 1, "cuda",
                                                         os.path.dirname(f"{folder}/x/{so}"))
    fn = lambda *a: runner.run(list(a))
print(how, "loaded", flush=True)
out = fn(x)
print(how, "ran", type(out), flush=True)
'''


def loads(a):
    """One toy package compiled once, then loaded several ways, each in its own process (gdb's backtrace first
    where gdb is here)."""
    import shutil

    with tempfile.TemporaryDirectory() as folder:
        p = subprocess.run([sys.executable, "-c", CASE, "bf16-inside", a.device, folder], capture_output=True, text=True)
        print("compiled:", p.returncode, flush=True)
        path = f"{folder}/bf16-inside.pt2"
        if shutil.which("gdb"):
            g = subprocess.run(["gdb", "-batch", "-ex", "run", "-ex", "bt 25", "--args", sys.executable, "-c", LOAD,
                                "default", path, folder], capture_output=True, text=True)
            print("\n".join([ln for ln in g.stdout.splitlines() if ln.startswith(("#", "Thread", "Program"))][:30]))
        else:
            print("no gdb here", flush=True)
        for how in a.loads.split(","):
            q = subprocess.run([sys.executable, "-c", LOAD, how, path, folder], capture_output=True, text=True)
            print(f"== load {how}: rc {q.returncode}", flush=True)
            print("\n".join((q.stdout + q.stderr).splitlines()[-8:]), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cases", default="bf16-inside,bf16-outside,bf16-outside-copy,fp8-inside,fp8-outside")
    ap.add_argument("--loads", default="", help="instead: one toy package loaded these ways (default,single,runner)")
    a = ap.parse_args()
    if a.loads:
        return loads(a)
    with tempfile.TemporaryDirectory() as folder:
        for case in a.cases.split(","):
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, "-c", CASE, case, a.device, folder], capture_output=True, text=True)
            lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith((case, "Fatal", "  File"))]
            print(f"== {case}: rc {p.returncode} in {time.perf_counter() - t0:.0f}s", flush=True)
            print("\n".join(lines[-12:]), flush=True)


if __name__ == "__main__":
    main()
