"""Generates the gRPC stubs from proto/ with grpcio-tools whenever the package is built or installed
(editable installs included), so generated code is never committed or edited by hand."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).parent


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        generate_stubs()
        super().run()


def generate_stubs() -> None:
    import grpc_tools
    from grpc_tools import protoc

    proto_root = ROOT / "proto"
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    files = sorted(str(p.relative_to(proto_root)) for p in proto_root.rglob("*.proto"))
    args = [
        "protoc",
        f"-I{proto_root}",
        f"-I{well_known}",
        f"--python_out={ROOT}",
        f"--pyi_out={ROOT}",
        f"--grpc_python_out={ROOT}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {files}")


setup(cmdclass={"build_py": BuildPyWithProtos})
