"""Where a published run happened and how it was started: the machine (CPU and the flags that decide its kernels,
cores, threads, date, package versions) and the command line, as a results page shows them under its title.

    from benchmarks.provenance import command_line, machine
    results = {"command": command_line(), "machine": machine(threads=2), ...}

Standard library only: the benchmarks' workers import it inside other engines' virtual environments.
"""

import datetime
import os
import platform
import shlex
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository, where the commands are typed
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")
PACKAGES = ("torch", "transformers", "onnxruntime", "onnx")


def cpu_description() -> dict:
    """The CPU's model name (as `lscpu` shows it, from /proc/cpuinfo) and which of the flags that decide the
    kernels (AVX2, AVX-512, VNNI, BF16, AMX) it has."""
    model, flags = platform.processor() or "unknown", set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    return {"model": model, "flags": {flag: flag in flags for flag in CPU_FLAGS}}


def machine(threads: int | None, shared: bool = True, packages: tuple[str, ...] = PACKAGES) -> dict:
    """Where and when a run happened: CPU, cores this process may use, the threads the run used, whether other jobs
    shared the machine, the UTC date and the installed versions of `packages`."""
    versions = {"python": platform.python_version()}
    for package in packages:
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return {
        "cpu": cpu_description(),
        "cores": len(os.sched_getaffinity(0)),
        "threads": threads,
        "shared": shared,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "versions": versions,
    }


def command_line() -> str:
    """This process's command as a reader would type it from the repository's root: `python -m benchmarks.NAME ...`
    for a benchmark run as a module, `python PATH ...` for a script run as a file (an example)."""
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        return shlex.join(["python", "-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]])
    script = Path(sys.argv[0]).resolve()
    shown = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script
    return shlex.join(["python", str(shown), *sys.argv[1:]])
