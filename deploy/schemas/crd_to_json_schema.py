"""Converts one version of a CustomResourceDefinition's openAPIV3Schema into the strict JSON schema
(draft 2020-12) that deploy/validate.py checks that kind against, the way kubeconform's
openapi2jsonschema converts CRDs:

- an object with `properties` and no `additionalProperties` gets `additionalProperties: false`
  (strict: an unknown field fails, as kubernetes-validate's strict mode makes it for built-in kinds);
- `x-kubernetes-int-or-string` becomes "an integer or a string", `nullable` adds "null" to the type;
- the other `x-kubernetes-*` extensions and the descriptions go. CEL rules
  (`x-kubernetes-validations`) cannot be checked here: tests/test_deploy.py checks those the
  manifests could break;
- apiVersion and kind become constants, and metadata the ObjectMeta subset the other schemas here
  use (a CRD leaves metadata to the API server).

Usage (PyYAML; .venv-deploy has it):
  python deploy/schemas/crd_to_json_schema.py CRD.yaml VERSION --source "WHERE THE CRD CAME FROM" > OUT.json
"""

import argparse
import json
import sys
from pathlib import Path

import yaml

METADATA = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "properties": {
        "name": {"$ref": "#/$defs/dnsName"},
        "namespace": {"$ref": "#/$defs/dnsName"},
        "labels": {"$ref": "#/$defs/stringMap"},
        "annotations": {"$ref": "#/$defs/stringMap"},
    },
}
DEFS = {
    "dnsName": {
        "type": "string",
        "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
        "maxLength": 253,
    },
    "stringMap": {"type": "object", "additionalProperties": {"type": "string"}},
}


def strict(schema: dict) -> dict:
    """``schema`` (an OpenAPI v3 schema of a CRD) as a strict JSON schema."""
    out = {}
    for key, value in schema.items():
        if key == "description" or key.startswith("x-kubernetes-") or key == "nullable":
            continue
        if key == "properties":
            value = {name: strict(prop) for name, prop in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            value = strict(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            value = [strict(option) for option in value]
        out[key] = value
    if schema.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def convert(crd: dict, version: str, source: str) -> dict:
    """The JSON schema of ``crd``'s ``version`` (a served version's openAPIV3Schema)."""
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version and v.get("served")]
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    schema = strict(served["schema"]["openAPIV3Schema"])
    schema["properties"].update(
        apiVersion={"const": f"{group}/{version}"}, kind={"const": kind}, metadata={"$ref": "#/$defs/metadata"}
    )
    schema["required"] = ["apiVersion", "kind", "metadata", *schema.get("required", [])]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"{kind} ({group}/{version})",
        "description": f"Converted by deploy/schemas/crd_to_json_schema.py from {source}: strict (a field the CRD "
        "does not define fails), descriptions and x-kubernetes-* extensions left out (its CEL rules are not checked "
        "here). deploy/validate.py applies it, since the Kubernetes schemas have no CRDs.",
        **schema,
        "$defs": {"metadata": METADATA, **DEFS},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("crd", type=Path, help="the CustomResourceDefinition's YAML")
    parser.add_argument("version", help="the version to convert, e.g. v1alpha1")
    parser.add_argument("--source", required=True, help="where the CRD came from (repository, tag, commit, path)")
    args = parser.parse_args()
    schema = convert(yaml.safe_load(args.crd.read_text()), args.version, args.source)
    json.dump(schema, sys.stdout, indent=2, ensure_ascii=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
