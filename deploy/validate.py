"""Validates rendered Kubernetes manifests (multi-document YAML files) against the Kubernetes
JSON schemas of one version, with kubernetes-validate (which ships the schemas; nothing is
downloaded), in strict mode: unknown fields fail. Custom resources, which those schemas lack,
are validated against the schemas in deploy/schemas/ (CRD_SCHEMAS); any other kind fails.

Usage: validate.py --kubernetes-version 1.32.0 rendered.yaml...   (run with .venv-deploy)
"""

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml
from kubernetes_validate.utils import SchemaNotFoundError

SCHEMAS = Path(__file__).parent / "schemas"
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SCHEMAS / "servicemonitor-v1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): SCHEMAS / "prometheusrule-v1.json",
    ("cert-manager.io/v1", "Certificate"): SCHEMAS / "certificate-v1.json",
    ("cert-manager.io/v1", "Issuer"): SCHEMAS / "issuer-v1.json",
    # converted from KEDA's CRD by crd_to_json_schema.py (the source is in the file's description)
    ("keda.sh/v1alpha1", "ScaledObject"): SCHEMAS / "scaledobject-v1alpha1.json",
}


def validate_resource(resource: dict, version: str) -> str | None:
    """Returns None when ``resource`` is valid, else the error."""
    crd_schema = CRD_SCHEMAS.get((resource.get("apiVersion"), resource.get("kind")))
    try:
        if crd_schema is not None:
            schema = json.loads(crd_schema.read_text())
            jsonschema.validate(resource, schema, cls=jsonschema.Draft202012Validator)
        else:
            kubernetes_validate.validate(resource, version, strict=True)
    except jsonschema.ValidationError as err:
        where = ".".join(str(part) for part in err.absolute_path) or "(top)"
        return f"{where}: {err.message}"
    except SchemaNotFoundError as err:
        return f"{err.message} (add its schema to deploy/schemas/ and CRD_SCHEMAS)"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kubernetes-version", required=True)
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args()
    failed = 0
    for path in args.files:
        resources = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
        kinds = Counter()
        for resource in resources:
            name = f"{resource.get('kind')}/{resource.get('metadata', {}).get('name')}"
            error = validate_resource(resource, args.kubernetes_version)
            if error:
                failed += 1
                print(f"ERROR {path.name}: {name}: {error}")
            else:
                kinds[resource["kind"]] += 1
        summary = ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items()))
        print(
            f"{path.name}: {sum(kinds.values())} of {len(resources)} resources valid against "
            f"Kubernetes {args.kubernetes_version} (strict): {summary}"
        )
        if not resources:
            failed += 1
            print(f"ERROR {path.name}: no resources")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
