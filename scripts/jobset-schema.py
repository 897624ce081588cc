#!/usr/bin/env python3
"""Write src/syncwise/launch/schemas/jobset.x-k8s.io_v1alpha2.json from the JobSet CRD YAML of a release.

    python3 scripts/jobset-schema.py CRD.yaml RELEASE COMMIT

CRD.yaml is config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml of kubernetes-sigs/jobset at RELEASE.
The v1alpha2 openAPIV3Schema is kept whole except its 'description' fields.
"""
import json
import sys
from pathlib import Path

import yaml

OUT = Path(__file__).resolve().parents[1] / "src" / "syncwise" / "launch" / "schemas" / "jobset.x-k8s.io_v1alpha2.json"


def strip(x):
    if isinstance(x, dict):
        return {k: strip(v) for k, v in x.items() if k != "description"}
    if isinstance(x, list):
        return [strip(v) for v in x]
    return x


def main(crd_path: str, release: str, commit: str) -> None:
    crd = yaml.safe_load(Path(crd_path).read_text())
    version = {v["name"]: v for v in crd["spec"]["versions"]}["v1alpha2"]
    out = {"crd": crd["metadata"]["name"], "group": crd["spec"]["group"], "kind": crd["spec"]["names"]["kind"],
           "version": "v1alpha2",
           "source": f"https://github.com/kubernetes-sigs/jobset/blob/{release}/config/components/crd/bases/"
                     "jobset.x-k8s.io_jobsets.yaml",
           "release": release, "commit": commit,
           "note": "spec.versions[v1alpha2].schema.openAPIV3Schema of the released CRD, with 'description' fields "
                   "removed (nothing else changed); regenerate with scripts/jobset-schema.py",
           "openAPIV3Schema": strip(version["schema"]["openAPIV3Schema"])}
    OUT.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print(f"wrote {OUT} ({OUT.stat().st_size:,} bytes)")


if __name__ == "__main__":
    main(*sys.argv[1:4])
