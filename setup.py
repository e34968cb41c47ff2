"""Build script.

- Maps the top-level kernels/ folder to spec_rl.kernels (docs/design.md "Module map").
- Builds the paged KV-cache ops in csrc/ as the extension ``spec_rl._C``
  (torch.utils.cpp_extension, ninja): C++ CPU kernels always; the CUDA kernels
  (.cu) too when this torch is a CUDA build (torch.version.cuda) and a CUDA
  toolkit is found (CUDA_HOME / nvcc). torch must already be installed, so
  install with ``pip install --no-build-isolation .`` (or ``-e .`` for an
  in-place development build).

Environment:
  SPEC_RL_EXT=cpu          build the CPU ops only, even where CUDA is available;
  SPEC_RL_EXT=none         build no extension (spec_rl.ops then runs the pure-torch reference, with a warning).
  MAX_JOBS=N               parallel compile jobs (ninja; torch's default is the CPU count).
  TORCH_CUDA_ARCH_LIST     CUDA archs, e.g. "9.0" (torch's default: the visible GPUs' archs).
"""

import glob
import os
import sys

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))

packages = find_packages(include=["spec_rl", "spec_rl.*"])
package_dir = {"spec_rl": "spec_rl"}
# Triton kernels live in kernels/ and install as spec_rl.kernels, never as a
# top-level `kernels` package (that name belongs to an unrelated PyPI project).
if os.path.isdir(os.path.join(HERE, "kernels")):
    packages.append("spec_rl.kernels")
    package_dir["spec_rl.kernels"] = "kernels"


def _extensions():
    """The spec_rl._C extension and its build command, or ([], {}) when skipped."""
    ext = os.environ.get("SPEC_RL_EXT", "auto")
    if ext not in ("auto", "cpu", "none"):
        raise RuntimeError(f"SPEC_RL_EXT must be auto, cpu or none, got {ext!r}")
    if ext == "none" or not os.path.isdir(os.path.join(HERE, "csrc")):
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError as exc:
        raise RuntimeError(
            "building spec_rl._C needs torch installed in this environment: install torch first, then "
            "`pip install --no-build-isolation .` (or set SPEC_RL_EXT=none to install without the native ops)"
        ) from exc

    # Relative paths: setuptools requires them, and they keep the build reproducible.
    cpp = sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "csrc", "*.cpp")))
    cu = sorted(os.path.relpath(p, HERE) for p in glob.glob(os.path.join(HERE, "csrc", "*.cu")))
    use_cuda = torch.version.cuda is not None and CUDA_HOME is not None and ext != "cpu"
    cxx, link = ["-O3"], []
    # at::parallel_for only runs in parallel when the caller is compiled with OpenMP
    # (ATen/ParallelOpenMP.h is guarded by _OPENMP); torch's own libgomp is already loaded.
    if sys.platform.startswith("linux") and torch.backends.openmp.is_available():
        cxx.append("-fopenmp")
        link.append("-fopenmp")
    if use_cuda:
        ext = CUDAExtension(
            "spec_rl._C",
            cpp + cu,
            include_dirs=[os.path.join(HERE, "csrc")],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "--expt-relaxed-constexpr"]},
            extra_link_args=link,
        )
    else:
        ext = CppExtension(
            "spec_rl._C",
            cpp,
            include_dirs=[os.path.join(HERE, "csrc")],
            extra_compile_args={"cxx": cxx},
            extra_link_args=link,
        )
    print(
        f"spec-rl: building spec_rl._C with {'CPU + CUDA' if use_cuda else 'CPU'} ops "
        f"(torch {torch.__version__}, CUDA_HOME={CUDA_HOME})"
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()
# The demo's warm-start policy ships with the package (spec_rl/tasks/demo_policy.py, WARM_START).
package_data = {"spec_rl.tasks": ["demo_warm_start/*"]}
setup(packages=packages, package_dir=package_dir, package_data=package_data, ext_modules=ext_modules, cmdclass=cmdclass)
