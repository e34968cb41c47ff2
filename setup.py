"""Build script: maps the top-level kernels/ folder to spec_rl.kernels (DESIGN.md)."""

import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))

packages = find_packages(include=["spec_rl", "spec_rl.*"])
package_dir = {"spec_rl": "spec_rl"}
# Triton kernels live in kernels/ and install as spec_rl.kernels, never as a
# top-level `kernels` package (that name belongs to an unrelated PyPI project).
if os.path.isdir(os.path.join(HERE, "kernels")):
    packages.append("spec_rl.kernels")
    package_dir["spec_rl.kernels"] = "kernels"

setup(packages=packages, package_dir=package_dir)
