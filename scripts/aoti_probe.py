"""Where does loading an AOTInductor package crash on this GPU? Each case in its own process (a segfault ends only
that case): a toy bf16 module with its weights inside the .so, the same with them outside (user-managed or copied
constants), and fp8 (torch._scaled_mm). Prints one line per case and step.
Run:  python3 scripts/aoti_probe.py [--device cuda] [--out DIR]
      python3 scripts/aoti_probe.py --loads default,single,runner [--env NAME=VALUE ...]
      python3 scripts/aoti_probe.py --diagnose   (the CUDA toolkit the wrapper was built against, its linked
      libraries, the last libraries loaded before the crash and a C backtrace from a preloaded signal handler)
      python3 scripts/aoti_probe.py --toolchain [--cxx-extra "-lstdc++" ...]   (the compiler's commands logged,
      the libstdc++ the wrapper binds to, and loads with each extra link flag and with the system libstdc++
      preloaded)"""

import argparse
import os
import shutil
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
import faulthandler, os, sys, time, zipfile, torch
if os.environ.get("FAULTHANDLER") != "0":
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
print(how, "maps", sorted({ln.split()[-1] for ln in open("/proc/self/maps") if "stdc++" in ln}), flush=True)
out = fn(x)
print(how, "ran", type(out), flush=True)
'''


SEGV = r'''
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
static void on_fault(int sig, siginfo_t *si, void *uc) {
  void *frames[64];
  char line[96];
  int n = backtrace(frames, 64);
  int k = snprintf(line, sizeof line, "fault: signal %d at address %p, %d frames\n", sig, si->si_addr, n);
  write(2, line, k);
  backtrace_symbols_fd(frames, n, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}
__attribute__((constructor)) static void install(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_RESETHAND;
  sigaction(SIGSEGV, &sa, 0);
  sigaction(SIGBUS, &sa, 0);
  sigaction(SIGABRT, &sa, 0);
}
'''


def _sh(cmd):
    p = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    return (p.stdout + p.stderr).strip()


def _load(how, path, folder, env=None, tail=8):
    q = subprocess.run([sys.executable, "-c", LOAD, how, path, folder], capture_output=True, text=True,
                       env={**os.environ, **(env or {})})
    print(f"== load {how} {env or ''}: rc {q.returncode}", flush=True)
    print("\n".join((q.stdout + q.stderr).splitlines()[-tail:]), flush=True)
    return q.stdout + q.stderr


def _symbols(text):
    """The backtrace's frames inside shared libraries, as function names (addr2line, demangled)."""
    import re

    for lib, off in re.findall(r"^(/\S+?\.so[.\d]*)\(\+(0x[0-9a-f]+)\)", text, re.M)[:16]:
        print(" ", os.path.basename(lib), off, _sh(f"addr2line -f -C -e {lib} {off} | head -1")[:160], flush=True)


def diagnose(a):
    """Why does a CUDA package crash on load here: the toolkit and libraries the wrapper was built and linked
    against, then one toy package loaded with a C backtrace on the fault, with the libraries loaded last, and with
    the environment variants that could matter."""
    import zipfile

    import torch
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME or ""
    site = os.path.dirname(os.path.dirname(torch.__file__))
    print("torch", torch.__version__, "cuda", torch.version.cuda, "CUDA_HOME", home, flush=True)
    print(_sh(f"nvcc --version | tail -2; grep -m1 'define CUDA_VERSION' {home}/include/cuda.h; "
              f"ls -d /usr/local/cuda* {site}/nvidia/*/ 2>&1 | head; ls {site}/nvidia/cu13/lib 2>&1 | head -30; "
              f"ls {site}/nvidia/cu13/include 2>&1 | head -5; gcc --version | head -1"), flush=True)
    with tempfile.TemporaryDirectory() as folder:
        handler = f"{folder}/segv.so"
        with open(f"{folder}/segv.c", "w") as f:
            f.write(SEGV)
        print("handler:", _sh(f"gcc -shared -fPIC -O1 -o {handler} {folder}/segv.c") or "built", flush=True)
        p = subprocess.run([sys.executable, "-c", CASE, "bf16-inside", a.device, folder], capture_output=True,
                           text=True)
        print("compiled:", p.returncode, "\n".join((p.stdout + p.stderr).splitlines()[-3:]), flush=True)
        path = f"{folder}/bf16-inside.pt2"
        with zipfile.ZipFile(path) as z:
            z.extractall(f"{folder}/so")
            names = z.namelist()
        for so in [n for n in names if n.endswith(".so")]:
            print("wrapper", so, "\n" + _sh(f"readelf -d {folder}/so/{so} | grep -E 'NEEDED|RPATH|RUNPATH'; "
                                          f"ldd {folder}/so/{so} | grep -v '^\\s*/lib'"), flush=True)
        print("members", [n for n in names if not n.endswith((".cubin", ".fatbin"))][:16], flush=True)
        _symbols(_load("default", path, folder, {"LD_PRELOAD": handler, "FAULTHANDLER": "0"}, tail=40))
        q = subprocess.run([sys.executable, "-c", LOAD, "default", path, folder], capture_output=True, text=True,
                           env={**os.environ, "LD_DEBUG": "libs"})
        opened = [ln.split("calling init:")[-1].strip() for ln in q.stderr.splitlines() if "calling init:" in ln]
        print("last libraries initialised before the end:", opened[-8:], flush=True)
        cudart = f"{site}/nvidia/cu13/lib/libcudart.so.13"
        for env in [{"CUDA_MODULE_LOADING": "EAGER"}, {"LD_PRELOAD": cudart} if os.path.exists(cudart) else None,
                    {"TORCH_CUDA_ARCH_LIST": "9.0"}]:
            if env:
                _load("default", path, folder, env)
        for how in ("single", "runner"):
            _load(how, path, folder, {"LD_PRELOAD": handler}, tail=25)


def toolchain(a):
    """The toy compiled through a logging compiler wrapper (CXX), once plainly and once per --cxx-extra (flags
    appended to every link), each loaded plainly and with the system libstdc++ preloaded."""
    import glob

    with tempfile.TemporaryDirectory() as folder:
        print(_sh("env | grep -iE '^(CXX|CC|LD_|LIBRARY)' ; ldconfig -p | grep -E 'stdc\\+\\+'; "
                  "strings /lib/x86_64-linux-gnu/libstdc++.so.6 | grep -E '^GLIBCXX_3\\.4\\.3[0-9]$' | tail -1"),
              flush=True)
        system = (glob.glob("/lib/x86_64-linux-gnu/libstdc++.so.6") + glob.glob("/usr/lib64/libstdc++.so.6"))[:1]
        for i, extra in enumerate([""] + a.cxx_extra):
            cxx = f"{folder}/cxx{i}"
            with open(cxx, "w") as f:
                f.write(f'#!/bin/sh\necho "$@" >> {folder}/cxx{i}.log\n'
                        f'case "$*" in *" -o "*.so*) exec g++ "$@" {extra};; esac\nexec g++ "$@"\n')
            os.chmod(cxx, 0o755)
            sub = f"{folder}/{i}"
            os.makedirs(sub)
            p = subprocess.run([sys.executable, "-c", CASE, "bf16-inside", a.device, sub], capture_output=True,
                               text=True, env={**os.environ, "CXX": cxx})
            print(f"== compiled with extra {extra!r}: rc {p.returncode}", "\n".join(p.stdout.splitlines()[-2:]),
                  flush=True)
            log = open(f"{folder}/cxx{i}.log").read() if os.path.exists(f"{folder}/cxx{i}.log") else ""
            links = [ln for ln in log.splitlines() if ".so" in ln and " -o " in ln]
            print("link:", (links[-1] if links else log[-600:])[-900:], flush=True)
            path = f"{sub}/bf16-inside.pt2"
            if not os.path.exists(path):
                continue
            import zipfile

            with zipfile.ZipFile(path) as z:
                so = next(n for n in z.namelist() if n.endswith(".so"))
                z.extract(so, f"{sub}/x")
            print(_sh(f"readelf -d {sub}/x/{so} | grep NEEDED | tr -s ' ' | cut -d' ' -f6 | tr '\\n' ' '; echo; "
                      f"nm -D --defined-only {sub}/x/{so} | grep -c locale; nm -D -u {sub}/x/{so} | grep -c GLIBCXX"),
                  flush=True)
            _load("default", path, sub, tail=4)
            if system:
                _load("default", path, sub, {"LD_PRELOAD": system[0]}, tail=4)


def loads(a):
    """One toy package compiled once, then loaded several ways, each in its own process (gdb's backtrace first
    where gdb is here)."""
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
        env = dict(kv.split("=", 1) for kv in a.env)
        for how in a.loads.split(","):
            _load(how, path, folder, env)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cases", default="bf16-inside,bf16-outside,bf16-outside-copy,fp8-inside,fp8-outside")
    ap.add_argument("--loads", default="", help="instead: one toy package loaded these ways (default,single,runner)")
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE set for each --loads process")
    ap.add_argument("--diagnose", action="store_true", help="instead: why a CUDA package crashes on load")
    ap.add_argument("--toolchain", action="store_true", help="instead: which libstdc++ the wrapper binds to")
    ap.add_argument("--cxx-extra", action="append", default=[], help="with --toolchain: flags added to each link")
    a = ap.parse_args()
    if a.toolchain:
        return toolchain(a)
    if a.diagnose:
        return diagnose(a)
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
