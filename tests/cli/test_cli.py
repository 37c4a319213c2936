import json
import subprocess
import sys

from treespec_sglang.cli import main


def test_policies_lists_every_policy_with_defaults(capsys):
    assert main(["policies", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert set(rows) == {"eagle2", "talon", "salf", "c2t", "chain"}
    assert rows["talon"] == {"budget": 60, "topk": 10, "mu": 0.03}
    assert rows["salf"]["th"] == 0.6


def test_module_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "treespec_sglang", "policies"], capture_output=True, text=True,
                         check=True).stdout
    assert "talon" in out and "mu=0.03" in out


def test_every_subpackage_is_packaged():
    """pyproject lists packages explicitly (patches/ maps to treespec_sglang.patches): none missing."""
    import pathlib
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[2]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "treespec_sglang").rglob("__init__.py")
             if "shim" not in p.parts}  # plugin/cpu/shim/sgl_kernel ships as package data, never as a package
    assert found | {"treespec_sglang.patches"} == listed
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "shim/sgl_kernel/__init__.py" in data["treespec_sglang.plugin.cpu"]
