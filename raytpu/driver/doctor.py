"""``raytpu doctor``: versions, devices, known conflicts and the Ray cluster, checked without holding a TPU.

Nothing here initialises an XLA device: TPU chips are counted from device files and
environment variables (as Ray counts them), torch_xla is asked only in a short
subprocess when ``--probe-xla`` is given, and the Ray cluster is reached from a
subprocess with a timeout. The exit code is 1 when a blocking problem was found
(torch / torch_xla mismatch, a named cluster that cannot be reached, a TPU held by
another process), else 0.
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from raytpu.cluster.connect import DEFAULT_TIMEOUT_S, one_line, resolve_address
from raytpu.cluster.probe import check_cluster
from raytpu.runtime.tpu import parse_pod_type

LIBTPU_LOCKFILE = "/tmp/libtpu_lockfile"
PROBE_MARK = "RAYTPU_PROBE "
PROBE_ERROR_MARK = "RAYTPU_PROBE_ERROR "
TPU_ENV_VARS = (
    "PJRT_DEVICE",
    "TPU_ACCELERATOR_TYPE",
    "TPU_TOPOLOGY",
    "TPU_WORKER_ID",
    "TPU_WORKER_HOSTNAMES",
    "TPU_NAME",
    "TPU_VISIBLE_CHIPS",
    "TPU_PROCESS_BOUNDS",
    "TPU_CHIPS_PER_PROCESS_BOUNDS",
    "TPU_HOST_BOUNDS",
    "TPU_CHIPS_PER_HOST_BOUNDS",
)
XLA_PROBE = (
    "import json, torch_xla, torch_xla.runtime as xr\n"
    "print('RAYTPU_PROBE ' + json.dumps({'device_type': xr.device_type(),"
    " 'global_devices': xr.global_runtime_device_count(),"
    " 'local_devices': xr.addressable_runtime_device_count()}))\n"
)


def problem(check: str, message: str, blocking: bool) -> dict[str, Any]:
    return {"check": check, "blocking": blocking, "message": message}


# ------------------------------------------------------------------ versions
def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def release(version: str) -> tuple[int, int, int] | None:
    """``"2.9.0+cu128"`` -> ``(2, 9, 0)``; local labels and pre/dev suffixes are ignored."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
    return (int(match[1]), int(match[2]), int(match[3] or 0)) if match else None


def check_torch_xla_match(torch_version: str | None, xla_version: str | None) -> dict[str, Any]:
    """torch_xla X.Y.Z needs torch X.Y.Z exactly; a missing torch_xla only means no xla runtime."""
    if torch_version is None:
        return {"ok": False, "blocking": True, "message": "torch is not installed: pip install 'torch==2.9.0'"}
    if xla_version is None:
        return {"ok": True, "blocking": False, "message": "torch_xla not installed: no xla runtime (fine off TPU)"}
    wanted = release(xla_version)
    if wanted is not None and release(torch_version) == wanted:
        return {"ok": True, "blocking": False, "message": f"torch {torch_version} matches torch_xla {xla_version}"}
    pin = ".".join(str(n) for n in wanted) if wanted else xla_version
    return {
        "ok": False,
        "blocking": True,
        "message": f"torch {torch_version} does not match torch_xla {xla_version} (import torch_xla fails with "
        f"'undefined symbol'): pip install 'torch=={pin}' 'torch_xla=={pin}' together",
    }


def check_torchvision(torch_version: str | None, vision_version: str | None) -> dict[str, Any] | None:
    """torchvision 0.(N+15) goes with torch 2.N; another one fails to load its operators."""
    torch_release = release(torch_version or "")
    vision_release = release(vision_version or "")
    if torch_release is None or vision_release is None or torch_release[0] != 2:
        return None
    expected = (0, torch_release[1] + 15)
    if vision_release[:2] == expected:
        return None
    pin = f"0.{expected[1]}.{torch_release[2]}"
    message = f"torchvision {vision_version} was not built for torch {torch_version}: pip install 'torchvision=={pin}'"
    return problem("torchvision", message, blocking=False)


def collect_versions() -> dict[str, Any]:
    names = ("torch", "torch_xla", "torch_tpu", "ray", "raytpu", "libtpu", "torchvision", "tensorflow")
    versions: dict[str, Any] = {"python": platform.python_version(), "python_executable": sys.executable}
    versions.update({name: package_version(name) for name in names})
    return versions


# ------------------------------------------------------------------- devices
def ray_tpu_chips() -> int | None:
    """TPU chips on this node as Ray counts them (``/dev/accel*``, or TPU-backed ``/dev/vfio`` groups)."""
    try:
        from ray.util.tpu import get_num_tpu_chips_on_node

        return int(get_num_tpu_chips_on_node())
    except Exception:
        return None


def slice_summary(pod_type: str) -> dict[str, Any]:
    try:
        spec = parse_pod_type(pod_type)
    except ValueError as exc:
        return {"pod_type": pod_type, "error": str(exc)}
    fields = ("topology", "num_hosts", "chips_per_host", "num_chips", "accelerator_type")
    return {"pod_type": spec.pod_type, **{name: getattr(spec, name) for name in fields}}


def tpu_devices() -> dict[str, Any]:
    accel = sorted(p for p in glob.glob("/dev/accel*") if not os.path.isdir(p))
    groups = os.listdir("/dev/vfio") if os.path.isdir("/dev/vfio") else []
    vfio = sorted(f"/dev/vfio/{g}" for g in groups if g.isdigit())
    env = {name: os.environ[name] for name in TPU_ENV_VARS if os.environ.get(name)}
    counted = ray_tpu_chips()
    info: dict[str, Any] = {"chips": counted if counted is not None else len(accel) or len(vfio)}
    info.update(device_files=accel + vfio, env=env)
    if env.get("TPU_ACCELERATOR_TYPE"):
        info["slice"] = slice_summary(env["TPU_ACCELERATOR_TYPE"])
    return info


def cuda_devices() -> dict[str, Any]:
    try:
        import torch
    except Exception as exc:
        return {"available": False, "count": 0, "error": one_line(exc)}
    if not torch.cuda.is_available():
        return {"available": False, "count": 0, "cuda_build": torch.version.cuda}
    from raytpu.runtime.base import local_gpu_has_bf16

    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"available": True, "count": len(names), "names": names, "bf16": local_gpu_has_bf16(0)}


def cpu_devices() -> dict[str, Any]:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"count": os.cpu_count(), "usable": usable}


def probe_xla(timeout: float) -> dict[str, Any]:
    """Ask torch_xla which devices it sees, in a subprocess (the runtime, and a TPU, are released on exit)."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", XLA_PROBE], capture_output=True, text=True, timeout=timeout, env=dict(os.environ)
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"torch_xla did not answer within {timeout:g} s"}
    for line in done.stdout.splitlines():
        if line.startswith(PROBE_MARK):
            return {"ok": True, **json.loads(line[len(PROBE_MARK) :])}
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return {"ok": False, "error": f"exit code {done.returncode}: {tail}"}


def auto_choice(
    tpu_chips: int, xla_installed: bool, cuda: dict[str, Any], torch_tpu_installed: bool = False
) -> dict[str, Any]:
    """What ``runtime: auto`` / ``precision: auto`` pick on this machine (each runtime's description
    says what it needs: ``raytpu.runtime.kinds``)."""
    try:
        from raytpu.runtime.kinds import Machine, by_auto_order
    except Exception as exc:
        return {"runtime": None, "precision": None, "error": one_line(exc)}
    tpu = tpu_chips > 0 or os.environ.get("PJRT_DEVICE", "").upper() == "TPU"
    installed = {
        name for name, present in (("torch_xla", xla_installed), ("torch_tpu", torch_tpu_installed)) if present
    }
    gpus = 1 if cuda.get("available") else 0
    machine = Machine(max(tpu_chips, int(tpu)), gpus, bool(cuda.get("bf16", True)), frozenset(installed))
    kind = next(kind for kind in by_auto_order() if kind.here(machine))
    precision, _ = kind.precision("auto", machine.gpu_bf16)
    choice: dict[str, Any] = {"runtime": kind.name, "precision": precision}
    missing = [text for text in (other.missing_here(machine) for other in by_auto_order()) if text]
    if missing:
        choice["note"] = missing[0]
    elif kind.accelerator:
        choice["note"] = kind.auto_precision_reason(precision)
    return choice


# ----------------------------------------------------------------- conflicts
def tpu_holders(lockfile: str = LIBTPU_LOCKFILE) -> list[dict[str, Any]]:
    """Other processes with the libtpu lock file or a TPU device open (those this user may inspect)."""
    holders = []
    for fd_dir in glob.glob("/proc/[0-9]*/fd"):
        pid = int(fd_dir.split("/")[2])
        if pid != os.getpid() and _holds_tpu(fd_dir, lockfile):
            holders.append({"pid": pid, "command": _command_line(pid)})
    return holders


def _holds_tpu(fd_dir: str, lockfile: str) -> bool:
    try:
        targets = [os.readlink(os.path.join(fd_dir, fd)) for fd in os.listdir(fd_dir)]
    except OSError:
        return False
    return any(t == lockfile or t.startswith(("/dev/accel", "/dev/vfio/")) for t in targets)


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return "?"


def check_libtpu_lock(lock_exists: bool, holders: list[dict[str, Any]]) -> dict[str, Any] | None:
    """A TPU held by another process blocks training; a lock file nobody holds is stale."""
    if holders:
        who = ", ".join(f"pid {h['pid']} ({h['command'] or '?'})" for h in holders)
        message = f"the TPU is in use by {who}: stop it (or wait for it) before training on this host"
        return problem("libtpu_lock", message, blocking=True)
    if lock_exists:
        message = (
            f"{LIBTPU_LOCKFILE} exists but no process this user can see holds the TPU (a crashed run left it?): "
            f"remove it with `rm {LIBTPU_LOCKFILE}` if nothing else uses the TPU"
        )
        return problem("libtpu_lock", message, blocking=False)
    return None


def check_tensorflow(tensorflow_version: str | None, xla_version: str | None) -> dict[str, Any] | None:
    if tensorflow_version is None or xla_version is None:
        return None
    message = (
        f"tensorflow {tensorflow_version} is installed beside torch_xla: a process that imports it can take the "
        "TPU (libtpu lock) or load a second libtpu; pip uninstall tensorflow, or never import it in training code"
    )
    return problem("tensorflow", message, blocking=False)


def check_torch_tpu(torch_tpu_version: str | None, tpu_chips: int) -> dict[str, Any] | None:
    """TorchTPU installed on a machine without TPU chips: it cannot run there (no CPU mode), and raytpu
    keeps its autoload (seconds at every ``import torch``) off."""
    if torch_tpu_version is None or tpu_chips:
        return None
    message = (
        f"torch_tpu {torch_tpu_version} is installed but this machine has no TPU chips: TorchTPU has no CPU mode "
        "(scaling.runtime=torch_tpu runs on TPU VMs only); raytpu keeps its autoload off here"
    )
    return problem("torch_tpu", message, blocking=False)


def collect_conflicts(
    versions: dict[str, Any], lockfile: str = LIBTPU_LOCKFILE, tpu_chips: int = 0
) -> list[dict[str, Any]]:
    found = [
        check_torch_tpu(versions.get("torch_tpu"), tpu_chips),
        check_tensorflow(versions.get("tensorflow"), versions.get("torch_xla")),
        check_torchvision(versions.get("torch"), versions.get("torchvision")),
        check_libtpu_lock(os.path.exists(lockfile), tpu_holders(lockfile)),
    ]
    return [c for c in found if c is not None]


# -------------------------------------------------------------------- report
def gather_problems(match: dict[str, Any], conflicts: list[dict[str, Any]], cluster: dict[str, Any]) -> list[dict]:
    problems = [] if match["ok"] else [problem("torch_xla_match", match["message"], match["blocking"])]
    problems += conflicts
    if cluster["reachable"] is False:
        problems.append(problem("cluster", cluster["message"], blocking=True))
    return problems


def exit_code(problems: list[dict[str, Any]]) -> int:
    """1 when any problem is blocking, else 0 (warnings alone do not fail)."""
    return 1 if any(p["blocking"] for p in problems) else 0


def collect_report(
    address: str | None = None, timeout: float = DEFAULT_TIMEOUT_S, xla_probe: bool = False
) -> dict[str, Any]:
    """Everything ``raytpu doctor`` checks, as a JSON-serialisable dict."""
    versions = collect_versions()
    match = check_torch_xla_match(versions["torch"], versions["torch_xla"])
    devices = {"tpu": tpu_devices(), "cuda": cuda_devices(), "cpu": cpu_devices()}
    conflicts = collect_conflicts(versions, tpu_chips=devices["tpu"]["chips"])
    if xla_probe and versions["torch_xla"] and not any(c["blocking"] for c in conflicts):
        devices["xla_probe"] = probe_xla(timeout)
    cluster = check_cluster(resolve_address(address), timeout)
    problems = gather_problems(match, conflicts, cluster)
    return {
        "versions": versions,
        "torch_xla_match": match,
        "devices": devices,
        "auto": auto_choice(
            devices["tpu"]["chips"],
            versions["torch_xla"] is not None,
            devices["cuda"],
            versions["torch_tpu"] is not None,
        ),
        "conflicts": conflicts,
        "cluster": cluster,
        "problems": problems,
        "blocking": exit_code(problems) != 0,
    }


def format_report(report: dict[str, Any]) -> str:
    """The report as a short readable table."""
    v, d = report["versions"], report["devices"]
    rows = [
        ("python", f"{v['python']} ({v['python_executable']})"),
        ("torch", v["torch"] or "not installed"),
        ("torch_xla", f"{v['torch_xla'] or 'not installed'} - {report['torch_xla_match']['message']}"),
        ("ray", v["ray"] or "not installed"),
        ("tpu", _tpu_line(d["tpu"])),
        ("cuda", ", ".join(d["cuda"].get("names", [])) or "no GPU"),
        ("cpu", f"{d['cpu']['usable']} usable of {d['cpu']['count']} cores"),
        ("auto", _auto_line(report["auto"])),
        ("cluster", _cluster_line(report["cluster"])),
    ]
    if "xla_probe" in d:
        rows.insert(5, ("xla probe", json.dumps(d["xla_probe"])))
    lines = [f"{name:<10} {value}" for name, value in rows]
    lines += [f"  {_node_line(n)}" for n in report["cluster"]["nodes"]]
    lines += [f"{'BLOCKING' if p['blocking'] else 'warning':<10} {p['message']}" for p in report["problems"]]
    lines.append("result     " + ("blocking problem(s) found" if report["blocking"] else "ok"))
    return "\n".join(lines)


def _tpu_line(tpu: dict[str, Any]) -> str:
    text = f"{tpu['chips']} chip(s)" + (f" ({', '.join(tpu['device_files'])})" if tpu["device_files"] else "")
    spec = tpu.get("slice")
    if spec and "error" not in spec:
        text += f", slice {spec['pod_type']}: {spec['num_hosts']} host(s) x {spec['chips_per_host']} chips"
    elif spec:
        text += f", slice {spec['pod_type']}: {spec['error']}"
    return text


def _auto_line(auto: dict[str, Any]) -> str:
    extra = auto.get("note") or auto.get("error")
    return f"runtime {auto['runtime']}, precision {auto['precision']}" + (f" ({extra})" if extra else "")


def _cluster_line(cluster: dict[str, Any]) -> str:
    if not cluster.get("auto_runtime"):
        return cluster["message"]
    return f"{cluster['message']}; auto runtime there: {cluster['auto_runtime']} ({cluster['auto_why']})"


def _node_line(node: dict[str, Any]) -> str:
    state = "alive" if node["alive"] else "dead"
    labels = " ".join(f"{k.removeprefix('ray.io/')}={v}" for k, v in node["tpu_labels"].items())
    return f"{node['ip']:<15} {state:<5} {json.dumps(node['resources'])} {labels}".rstrip()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raytpu doctor", description="check versions, devices and the Ray cluster")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--address", help="Ray cluster to check (default: RAY_ADDRESS; none: a local one is used)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per probe (default 30)")
    parser.add_argument("--probe-xla", action="store_true", help="ask torch_xla for its devices (in a subprocess)")
    parser.add_argument("config", nargs="?", help="a YAML config: its memory per device, estimated")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="key=value overrides of the config")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report = collect_report(args.address, args.timeout, args.probe_xla)
    if args.config:
        report["memory"] = memory_estimate(args.config, list(args.overrides))
    text = format_report(report) + "".join(f"\n{line}" for line in report.get("memory", []))
    print(json.dumps(report, indent=2) if args.json else text, flush=True)
    return exit_code(report["problems"])


def memory_estimate(path: str, overrides: list[str]) -> list[str]:
    """``raytpu doctor CONFIG``: the config's memory per device (``raytpu.config.memory``)."""
    from raytpu.config import load_config
    from raytpu.config.memory import estimate_lines
    from raytpu.config.plan import batch_plans, elastic_note

    cfg, job = load_config(path, overrides)
    lines = ["memory     " + line if index == 0 else line for index, line in enumerate(estimate_lines(cfg, job))]
    return lines + [f"workers    {note}" for note in elastic_note(cfg, batch_plans(cfg))] + multislice_lines(cfg)


def multislice_lines(cfg: Any) -> list[str]:
    """What a run over several TPU slices (``scaling.tpu.slices``) needs and how its mesh spans them."""
    from raytpu.config import ConfigError
    from raytpu.parallel.slices import slice_mesh
    from raytpu.runtime.tpu import slice_spec

    tpu, mesh = cfg.scaling.tpu, cfg.sharding.mesh
    if tpu.slices < 2 or not tpu.accelerator_type:
        return []
    spec = slice_spec(tpu.accelerator_type, tpu.topology)
    fsdp = -1 if cfg.sharding.strategy == "full_shard" and mesh.fsdp == 1 else mesh.fsdp
    try:
        whole, ici, dcn = slice_mesh(spec.num_chips * tpu.slices, tpu.slices, mesh.data, fsdp, mesh.tensor)
        layout = f"mesh {whole.describe()}: HybridMesh ici {ici}, dcn {dcn} (the data axis across the slices)"
    except ConfigError as error:
        layout = f"mesh: {error}"
    hosts = f"{spec.num_hosts} host(s) x {spec.chips_per_host} chips each"
    return [
        f"slices     {tpu.slices} x {spec.pod_type} ({hosts}); {layout}",
        "           each worker gets MEGASCALE_COORDINATOR_ADDRESS (rank 0's slice, TPU worker 0), MEGASCALE_PORT "
        "(8081), MEGASCALE_NUM_SLICES and its MEGASCALE_SLICE_ID from raytpu's backend",
        "           needs: slices of one type and topology, scaling.tpu.layout=spmd, the port open between the "
        "slices' hosts (one VPC network), torch_xla[tpu] of one version on every host",
    ]


if __name__ == "__main__":
    sys.exit(main())
